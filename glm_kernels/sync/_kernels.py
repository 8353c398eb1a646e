"""Triton kernel of FP8 block quantization (definition: ``_reference.quantize_fp8_blocks``)."""
import torch
import triton
import triton.language as tl

from .._aot import AotSpec

# 128 x 128 fp32 values per program: 8 warps keep them at 64 registers' worth a thread
NUM_WARPS = 8


@triton.jit
def _to_e4m3fn_bits(x):
    # float8_e4m3fn bits of fp32 x (|x| <= 448), rounded to nearest even, in integer ops: the
    # same bits on every GPU and in the interpreter (whose fp8 cast rounds differently).
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # normal range (|x| >= 2^-6): keep 3 mantissa bits with round-half-even, rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    normal = tl.minimum(normal, 0x7E)
    # subnormal range: steps of 2^-9; adding 2^14 (ulp 2^-9) rounds to nearest even in the add
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
    code = tl.where(a >= 0x3C800000, normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8_block_quant_kernel(w_ptr, q_ptr, s_ptr, rows, cols, stride_w, stride_q, n_col_blocks,
                            BR: tl.constexpr, BC: tl.constexpr):
    # One program per (block row, block column): read the block once, reduce |w| to its
    # amax in fp32, scale with a correctly rounded 448 / amax (what torch computes), cast.
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BR + tl.arange(0, BR)
    c = pid_c * BC + tl.arange(0, BC)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    w = tl.load(w_ptr + r[:, None].to(tl.int64) * stride_w + c[None, :], mask=mask,
                other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(w), axis=1), axis=0), 1e-4)
    scale = tl.math.div_rn(tl.full((), 448.0, tl.float32), amax)
    q = _to_e4m3fn_bits(w * scale)
    tl.store(q_ptr + r[:, None].to(tl.int64) * stride_q + c[None, :], q, mask=mask)
    tl.store(s_ptr + pid_r * n_col_blocks + pid_c, tl.math.div_rn(amax, 448.0))


def quantize_fp8_blocks(w: torch.Tensor, block=(128, 128)):
    """Launcher: ``w`` contiguous 2-D (bf16, fp16 or fp32) -> (q, scale_inv)."""
    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    q = torch.empty(rows, cols, dtype=torch.uint8, device=w.device)
    s = torch.empty(nr, nc, dtype=torch.float32, device=w.device)
    if rows and cols:
        _fp8_block_quant_kernel[(nr, nc)](w, q, s, rows, cols, w.stride(0), q.stride(0), nc,
                                          BR=br, BC=bc, num_warps=NUM_WARPS)
    return q.view(torch.float8_e4m3fn), s


AOT_SPECS = [AotSpec(f"fp8_block_quant[{dtype},128x128]", _fp8_block_quant_kernel,
                     {"w_ptr": f"*{dtype}", "q_ptr": "*u8", "s_ptr": "*fp32", "rows": "i32",
                      "cols": "i32", "stride_w": "i32", "stride_q": "i32",
                      "n_col_blocks": "i32"},
                     dict(BR=128, BC=128), NUM_WARPS, num_stages=1)
             for dtype in ("bf16", "fp16", "fp32")]
