"""IcePop loss forward+backward: glm_kernels vs torch eager / torch.compile / Liger, vs floor.

Floor: the bytes a fused fwd+bwd must move at least -- read logprobs, rollout_logprobs,
advantages (fp32) and the bool mask, write the fp32 gradient: 17 B/token -- over the copy
bandwidth measured in the same run.

    python benchmarks/bench_icepop.py            # GPU sizes 64K, 1M, 16M tokens
    python benchmarks/bench_icepop.py --cpu      # CPU sizes, plus an interpreter check

``glm_kernels_metrics`` is the same call with ``return_metrics=True`` (the mismatch metrics
fused into the pass); ``metrics_overhead`` = its time over ``glm_kernels``'s. With ``--cpu``
the two are also timed side by side in Triton's interpreter (labelled: CPU interpreter
figures, not GPU timing).
"""
from __future__ import annotations

import os
import sys

if "--cpu" in sys.argv:                      # the interpreter check needs this before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import glm_kernels  # noqa: E402
from glm_kernels import _dispatch  # noqa: E402
from glm_kernels.loss.icepop import _reference  # noqa: E402

BYTES_PER_TOKEN = 4 + 4 + 4 + 1 + 4


def make_inputs(n_tokens: int, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    lp = -torch.rand(n_tokens, device=device, generator=gen) * 3
    rollout = lp + 0.5 * torch.randn(n_tokens, device=device, generator=gen)
    adv = torch.randn(n_tokens, device=device, generator=gen)
    mask = torch.rand(n_tokens, device=device, generator=gen) > 0.1
    return lp, rollout, adv, mask


def _fwd_bwd(loss_fn, lp, rollout, adv, mask):
    lp = lp.detach().requires_grad_(True)

    def step():
        lp.grad = None
        loss_fn(lp, rollout, adv, mask).backward()
    return step


def _liger_provider():
    """Liger's Triton GRPO loss, fed logits whose log-softmax equals our log-probs.

    Liger starts from logits [B, T+1, V]; with V = 2 and logits (lp, log(1 - e^lp)) the
    selected log-prob is exactly lp, so it computes the same clipped PPO term at its minimum
    vocab cost. Its IS correction (``vllm_is_ratio``) is fed the masked IcePop gate when the
    installed version has it.
    """
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as exc:  # not installed, or no CUDA build
        return None, f"liger-kernel not importable ({type(exc).__name__})"

    def loss_fn(lp, rollout, adv, mask):
        other = torch.log1p(-lp.detach().exp().clamp(max=1 - 1e-6))
        logits = torch.stack([lp, other], -1)[None]                      # [1, N, 2]
        logits = torch.cat([logits, logits[:, :1]], 1)                   # T + 1 positions
        ids = torch.zeros(1, lp.numel(), dtype=torch.long, device=lp.device)
        ratio = (lp.detach() - rollout).exp()
        gate = ((ratio >= 0.5) & (ratio <= 2.0)).float()[None]
        try:
            out = triton_grpo_loss(logits, rollout[None], None, ids, adv.view(1, -1).mean(1),
                                   mask[None].int(), temperature=1.0, beta=0.0, eps_low=0.2,
                                   eps_high=0.28, inplace=False, vllm_is_ratio=gate)
        except TypeError:
            out = triton_grpo_loss(logits, rollout[None], None, ids, adv.view(1, -1).mean(1),
                                   mask[None].int(), temperature=1.0, beta=0.0, eps_low=0.2,
                                   eps_high=0.28, inplace=False)
        return out[0] if isinstance(out, tuple) else out
    return loss_fn, None


def run(quick: bool = False, cpu: bool = False) -> dict:
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    sizes = [1 << 16, 1 << 20] if (quick or device == "cpu") else [1 << 16, 1 << 20, 1 << 24]
    bandwidth = _common.copy_bandwidth(device)
    reference = lambda lp, r, a, m: _reference.icepop_loss_reference(lp, r, a, m)  # noqa: E731
    compiled = torch.compile(reference)
    providers = {"glm_kernels": lambda lp, r, a, m: glm_kernels.icepop_loss(lp, r, a, m),
                 "glm_kernels_metrics": _with_metrics,
                 "glm_kernels_dual_clip": lambda lp, r, a, m: glm_kernels.icepop_loss(
                     lp, r, a, m, dual_clip=3.0),
                 "torch_eager": reference, "torch_compile": compiled}
    notes = {}
    if device == "cuda":
        liger, why = _liger_provider()
        if liger is not None:
            providers["liger_grpo_triton_V2"] = liger
        else:
            notes["liger"] = why
    rows = []
    for n in sizes:
        inputs = make_inputs(n, device)
        floor_s = n * BYTES_PER_TOKEN / bandwidth
        row = {"tokens": n, "floor_us": floor_s * 1e6}
        for name, fn in providers.items():
            try:
                seconds = _common.time_fn(_fwd_bwd(fn, *inputs), device=device)
            except Exception as exc:  # a provider that fails is reported, not hidden
                notes[f"{name}@{n}"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                continue
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}/floor"] = seconds / floor_s
        if "glm_kernels_metrics_us" in row and "glm_kernels_us" in row:
            row["metrics_overhead"] = row["glm_kernels_metrics_us"] / row["glm_kernels_us"]
        if "glm_kernels_dual_clip_us" in row and "glm_kernels_us" in row:
            row["dual_clip_overhead"] = (row["glm_kernels_dual_clip_us"]
                                         / row["glm_kernels_us"])
        if "torch_eager_us" in row and "glm_kernels_us" in row:
            row["speedup_vs_eager"] = row["torch_eager_us"] / row["glm_kernels_us"]
        if "torch_compile_us" in row and "glm_kernels_us" in row:
            row["speedup_vs_compile"] = row["torch_compile_us"] / row["glm_kernels_us"]
        rows.append(row)
    backend = _dispatch.select_backend("icepop_loss", make_inputs(1, device)[0])
    columns = ["tokens", "floor_us"] + [c for p in providers for c in (f"{p}_us", f"{p}/floor")]
    columns += ["metrics_overhead", "dual_clip_overhead", "speedup_vs_eager",
                "speedup_vs_compile"]
    _common.print_table(f"icepop_loss fwd+bwd on {device} (glm_kernels backend: {backend}; "
                        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s measured)", rows, columns)
    result = {"benchmark": "icepop", "device": device, "glm_kernels_backend": backend,
              "copy_bandwidth_Bps": bandwidth, "bytes_per_token_floor": BYTES_PER_TOKEN,
              "rows": rows, "notes": notes, "fallbacks": _dispatch.fallbacks_logged(),
              "env": _common.environment()}
    return _common.finish(result, notes, {
        "interpreter_check": interpreter_check,
        "interpreter_metrics_side_by_side": interpreter_metrics_side_by_side})


def _with_metrics(lp, rollout, adv, mask):
    """The loss with the mismatch metrics requested (the metrics themselves are dropped)."""
    return glm_kernels.icepop_loss(lp, rollout, adv, mask, return_metrics=True)[0]


def interpreter_metrics_side_by_side(n_tokens: int = 1 << 14) -> dict:
    """return_metrics False vs True, fwd+bwd, in Triton's interpreter on the CPU: the
    metrics' extra per-token arithmetic as the interpreter runs it. CPU interpreter figures:
    they say nothing about GPU time (not measured on GPU)."""
    lp, rollout, adv, mask = make_inputs(n_tokens, "cpu", seed=2)
    rows = []
    with glm_kernels.force_backend("interpret"):
        for label, shape in (("flat", (n_tokens,)), ("rows of 2048", (-1, 2048))):
            inputs = [t.reshape(shape) for t in (lp, rollout, adv, mask)]
            row = {"input": f"{label} ({n_tokens} tokens)"}
            for name, fn in (("off", lambda a, b, c, d: glm_kernels.icepop_loss(a, b, c, d)),
                             ("on", _with_metrics)):
                row[f"metrics_{name}_ms"] = 1e3 * _common.time_fn(
                    _fwd_bwd(fn, *inputs), device="cpu", warmup=1, repeats=5)
            row["on/off"] = row["metrics_on_ms"] / row["metrics_off_ms"]
            rows.append(row)
    _common.print_table("icepop_loss fwd+bwd, return_metrics off vs on -- CPU, Triton "
                        "interpreter (not GPU timing)", rows,
                        ["input", "metrics_off_ms", "metrics_on_ms", "on/off"])
    return {"label": "CPU Triton interpreter, not GPU timing", "rows": rows}


def interpreter_check(n_tokens: int = 50_000) -> dict:
    """The Triton kernel (run by the interpreter) against the reference on fresh inputs."""
    lp, rollout, adv, mask = make_inputs(n_tokens, "cpu", seed=1)
    return _common.loss_grad_check(
        f"{n_tokens} tokens",
        lambda x: glm_kernels.icepop_loss(x, rollout, adv, mask),
        lambda x: _reference.icepop_loss_reference(x, rollout, adv, mask), lp)


if __name__ == "__main__":
    _common.main(__doc__, run)
