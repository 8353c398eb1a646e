"""Triton kernels for the reverse KL between two logits tensors. No validation here.

Same conventions as ``logprobs/_kernels.py`` ([N, V] rows, unit column stride, fp32 math on
z = logits * inv_temp, online statistics over vocab tiles).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..._aot import AotSpec
from .._common.tiles import lse_tile, safe_max


@triton.jit
def _reverse_kl_kernel(
    student_ptr, teacher_ptr,
    # outputs: final kl / lse_s / lse_t [N] each, or partial stats [N, 5]
    kl_ptr, lse_s_ptr, lse_t_ptr, partial_ptr,
    V, stride_s, stride_t, inv_temp,
    PARTIAL: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """KL(p_s || p_t) of one row in one sweep over both tensors:
    KL = u / s_s - (lse_s - lse_t), u = sum e^(z_s - m_s) (z_s - z_t) carried online like s_s.
    Partial (a vocab shard): (m_s, s_s, u, m_t, s_t)."""
    row = tl.program_id(0).to(tl.int64)
    base_s = student_ptr + row * stride_s
    base_t = teacher_ptr + row * stride_t
    m_s = tl.full([], float("-inf"), tl.float32)
    m_t = tl.full([], float("-inf"), tl.float32)
    s_s = tl.zeros([], tl.float32)
    s_t = tl.zeros([], tl.float32)
    u = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < V
        z_s = tl.load(base_s + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_temp
        z_t = tl.load(base_t + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m_s, tl.max(z_s, axis=0))
        shift = safe_max(m_new)
        alpha = tl.exp(m_s - shift)
        e = tl.exp(z_s - shift)
        u = u * alpha + tl.sum(e * tl.where(z_s > float("-inf"), z_s - z_t, 0.0), axis=0)
        s_s = s_s * alpha + tl.sum(e, axis=0)
        m_s = m_new
        m_t, s_t = lse_tile(m_t, s_t, z_t)
    if PARTIAL:
        out = partial_ptr + row * 5
        tl.store(out + 0, m_s)
        tl.store(out + 1, s_s)
        tl.store(out + 2, u)
        tl.store(out + 3, m_t)
        tl.store(out + 4, s_t)
    else:
        lse_s = m_s + tl.log(s_s)
        lse_t = m_t + tl.log(s_t)
        tl.store(kl_ptr + row, u / s_s - (lse_s - lse_t))
        tl.store(lse_s_ptr + row, lse_s)
        tl.store(lse_t_ptr + row, lse_t)


@triton.jit
def _reverse_kl_grad_kernel(
    student_ptr, teacher_ptr, lse_s_ptr, lse_t_ptr, kl_ptr, coef_ptr, grad_ptr,
    V, stride_s, stride_t, stride_grad, inv_temp, BLOCK_V: tl.constexpr,
):
    """d(coef * KL)/d student = coef / T * p_s (log p_s - log p_t - KL); exact 0 rows where
    coef == 0 and where p_s == 0."""
    row = tl.program_id(0).to(tl.int64)
    base_s = student_ptr + row * stride_s
    base_t = teacher_ptr + row * stride_t
    out = grad_ptr + row * stride_grad
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    kl = tl.load(kl_ptr + row)
    coef = tl.load(coef_ptr + row) * inv_temp
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < V
        log_s = tl.load(base_s + cols, mask=inside,
                        other=float("-inf")).to(tl.float32) * inv_temp - lse_s
        log_t = tl.load(base_t + cols, mask=inside,
                        other=float("-inf")).to(tl.float32) * inv_temp - lse_t
        p = tl.exp(log_s)
        term = p * tl.where(p > 0.0, log_s - log_t - kl, 0.0)
        g = tl.where(coef == 0.0, 0.0, coef * term)
        tl.store(out + cols, g.to(grad_ptr.dtype.element_ty), mask=inside)


# --------------------------------------------------------------------------- launchers
def reverse_kl(student, teacher, *, kl, lse_s, lse_t, partial, inv_temp, block_v, num_warps):
    """Final (kl, lse_s, lse_t) or, when ``partial`` is a tensor, [N, 5] shard statistics."""
    n, v = student.shape
    if n:
        dummy = student if partial is None else partial
        _reverse_kl_kernel[(n,)](
            student, teacher, dummy if kl is None else kl, dummy if lse_s is None else lse_s,
            dummy if lse_t is None else lse_t, dummy, v, student.stride(0), teacher.stride(0),
            inv_temp, PARTIAL=partial is not None, BLOCK_V=block_v, num_warps=num_warps)


def reverse_kl_grad(student, teacher, lse_s, lse_t, kl, coef, grad, *, inv_temp, block_v,
                    num_warps):
    n, v = student.shape
    if n:
        _reverse_kl_grad_kernel[(n,)](
            student, teacher, lse_s, lse_t, kl, coef, grad, v, student.stride(0),
            teacher.stride(0), grad.stride(0), inv_temp, BLOCK_V=block_v, num_warps=num_warps)


# --------------------------------------------------------------------------- AOT configurations
def _aot_specs():
    specs = []
    for dt in ("bf16", "fp32"):
        for partial in (False, True):
            sig = {"student_ptr": f"*{dt}", "teacher_ptr": f"*{dt}", "kl_ptr": "*fp32",
                   "lse_s_ptr": "*fp32", "lse_t_ptr": "*fp32", "partial_ptr": "*fp32",
                   "V": "i32", "stride_s": "i64", "stride_t": "i64", "inv_temp": "fp32",
                   "PARTIAL": "constexpr", "BLOCK_V": "constexpr"}
            specs.append(AotSpec(f"reverse_kl[{dt},partial={partial}]", _reverse_kl_kernel, sig,
                                 {"PARTIAL": partial, "BLOCK_V": 4096}, num_warps=8))
        sig = {"student_ptr": f"*{dt}", "teacher_ptr": f"*{dt}", "lse_s_ptr": "*fp32",
               "lse_t_ptr": "*fp32", "kl_ptr": "*fp32", "coef_ptr": "*fp32",
               "grad_ptr": f"*{dt}", "V": "i32", "stride_s": "i64", "stride_t": "i64",
               "stride_grad": "i64", "inv_temp": "fp32", "BLOCK_V": "constexpr"}
        specs.append(AotSpec(f"reverse_kl_grad[{dt}]", _reverse_kl_grad_kernel, sig,
                             {"BLOCK_V": 4096}, num_warps=8))
    return specs


AOT_SPECS = _aot_specs()
