"""Comparison helpers that say where and by how much two results differ.

Used by the test suite and the benchmarks' correctness checks; users may call them to check
the kernels on their own hardware (``assert_close(out, ref, tol=TOLERANCES[dtype])``).
"""
import torch

# docs/design.md 4: fp32 1e-5, tf32 3e-4, bf16 1e-2; fp16 and fp64 (not listed there) are
# this package's.
TOLERANCES = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2,
              torch.float16: 1e-3, "tf32": 3e-4}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 over finite entries (0 when both are zero)."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    num = (out64 - ref64).norm().item()
    den = ref64.norm().item()
    return num / den if den > 0 else num


def assert_close(out, ref, *, tol, name="result"):
    """Relative-norm check; on failure, report the worst element and its position."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    same_nan = torch.isnan(out.detach().double()) == torch.isnan(ref.detach().double())
    assert bool(same_nan.all()), (f"{name}: NaN positions differ at "
                                  f"{(~same_nan).nonzero()[:5].tolist()}")
    finite = ~torch.isnan(ref.detach().double())
    err = rel_error(out.detach()[finite], ref.detach()[finite])
    if err > tol:
        diff = (out.detach().double() - ref.detach().double()).abs().nan_to_num(0.0)
        worst = int(diff.reshape(-1).argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), out.shape))
        raise AssertionError(
            f"{name}: relative error {err:.3e} > {tol:.1e}; worst at {idx}: "
            f"{out.detach()[idx].item()!r} vs {ref.detach()[idx].item()!r}")


def assert_bits_equal(out: torch.Tensor, ref: torch.Tensor, name="result"):
    """Bit-exact equality (NaN payloads and signed zeros included)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{name}: {tuple(out.shape)}/{out.dtype} vs {tuple(ref.shape)}/{ref.dtype}")
    a = out.contiguous().reshape(-1).view(torch.uint8)   # flat: byte offsets for any rank
    b = ref.contiguous().reshape(-1).view(torch.uint8)
    neq = (a != b).nonzero()
    assert neq.numel() == 0, f"{name}: {neq.shape[0]} bytes differ, first at byte {neq[0].item()}"
