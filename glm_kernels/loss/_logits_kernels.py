"""Triton kernels for log-probs from logits. No validation: callers pass contiguous [N, V] rows."""
from __future__ import annotations

import triton
import triton.language as tl

from .._aot import AotSpec


@triton.jit
def _logprobs_fwd_kernel(logits_ptr, ids_ptr, lp_ptr, lse_ptr, V, stride_row, inv_temp,
                         BLOCK_V: tl.constexpr):
    """One row: online lse = m + log sum exp(x/T - m) over vocab blocks; lp = x_t/T - lse."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, x)
        # Lanes that have only seen -inf keep s = 0 (avoid exp(-inf - -inf) = NaN).
        safe = m_new > float("-inf")
        s = tl.where(safe, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - m_row), 0.0), axis=0)
    lse = m_row + tl.log(s_row)
    tid = tl.load(ids_ptr + row)
    target = tl.load(base + tid).to(tl.float32) * inv_temp
    tl.store(lse_ptr + row, lse)
    tl.store(lp_ptr + row, target - lse)


@triton.jit
def _logprobs_bwd_kernel(logits_ptr, ids_ptr, lse_ptr, coef_ptr, dlogits_ptr, V, stride_row,
                         stride_grad, inv_temp, BLOCK_V: tl.constexpr):
    """dlogits = coef / T * (onehot(t) - softmax(x/T)), softmax recomputed from the saved lse."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    out = dlogits_ptr + row * stride_grad
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row) * inv_temp
    tid = tl.load(ids_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        p = tl.exp(x - lse)
        g = coef * (tl.where(cols == tid, 1.0, 0.0) - p)
        tl.store(out + cols, g.to(dlogits_ptr.dtype.element_ty), mask=valid)


def logprobs_fwd(logits, ids, lp_out, lse_out, *, inv_temp, block_v, num_warps):
    n, v = logits.shape
    if n:
        _logprobs_fwd_kernel[(n,)](logits, ids, lp_out, lse_out, v, logits.stride(0), inv_temp,
                                   BLOCK_V=block_v, num_warps=num_warps)


def logprobs_bwd(logits, ids, lse, coef, dlogits, *, inv_temp, block_v, num_warps):
    n, v = logits.shape
    if n:
        _logprobs_bwd_kernel[(n,)](logits, ids, lse, coef, dlogits, v, logits.stride(0),
                                   dlogits.stride(0), inv_temp, BLOCK_V=block_v,
                                   num_warps=num_warps)


def _aot_specs():
    specs = []
    for dt in ("bf16", "fp32"):
        sig = {"logits_ptr": f"*{dt}", "ids_ptr": "*i64", "lp_ptr": "*fp32", "lse_ptr": "*fp32",
               "V": "i32", "stride_row": "i64", "inv_temp": "fp32", "BLOCK_V": "constexpr"}
        specs.append(AotSpec(f"logprobs_fwd[{dt}]", _logprobs_fwd_kernel, sig,
                             {"BLOCK_V": 4096}, num_warps=8))
        sig = {"logits_ptr": f"*{dt}", "ids_ptr": "*i64", "lse_ptr": "*fp32", "coef_ptr": "*fp32",
               "dlogits_ptr": f"*{dt}", "V": "i32", "stride_row": "i64", "stride_grad": "i64",
               "inv_temp": "fp32", "BLOCK_V": "constexpr"}
        specs.append(AotSpec(f"logprobs_bwd[{dt}]", _logprobs_bwd_kernel, sig,
                             {"BLOCK_V": 4096}, num_warps=8))
    return specs


AOT_SPECS = _aot_specs()
