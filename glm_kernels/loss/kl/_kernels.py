"""Triton kernel of the reference-KL penalty (``loss/kl/kl_penalty.py``; math in
``loss/kl/_reference.py``). No validation here: callers pass contiguous [rows, T] tensors.

One pass over [rows, T] tokens in 2-D tiles (BLOCK_R rows x BLOCK_T columns: short responses
share a tile, long ones span several) writes the per-token term and/or the gradient
coefficient m * dl/dlp, and one (sum l*m, sum m) pair per (row, column block): the row sums
every verl loss_agg_mode needs, reduced afterwards in a fixed order (no atomics).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..._aot import AotSpec
from ..._dispatch import next_power_of_2
from ._reference import ABS, K1, K2, K3

_TILE_TOKENS, _WARPS = 4096, 8
_MAX_BLOCK_T = 1024


@triton.jit
def kl_token_math(lp, ref, KIND: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr,
                  CLAMP: tl.constexpr):
    """(l, dl/dlp) for a tile (fp32). d = lp - ref; k1: d; abs: |d|; k2: d^2/2;
    k3: clamp(e^xc - xc - 1, -10, 10) with xc = clamp(ref - lp, -20, 20) (CLAMP: both clamps,
    torch.clamp's gradient: passes where min <= input <= max); straight-through: grad = d."""
    d = lp - ref
    if KIND == 1:          # K1 (codes: _kl_reference.KIND_CODES)
        terms = d
        grad = tl.full(d.shape, 1.0, tl.float32)
    elif KIND == 2:        # ABS
        terms = tl.abs(d)
        # torch.sign: -1, 0, 1, NaN for NaN
        grad = tl.where(d > 0.0, 1.0, tl.where(d < 0.0, -1.0, d * 0.0))
    elif KIND == 3:        # K2
        terms = 0.5 * d * d
        grad = d
    else:                  # K3
        x = -d
        if CLAMP:
            x_in = (x >= -20.0) & (x <= 20.0)
            x = tl.clamp(x, -20.0, 20.0, propagate_nan=tl.PropagateNan.ALL)
        ratio = tl.exp(x)
        terms = ratio - x - 1.0
        grad = 1.0 - ratio
        if CLAMP:
            term_in = (terms >= -10.0) & (terms <= 10.0)
            terms = tl.clamp(terms, -10.0, 10.0, propagate_nan=tl.PropagateNan.ALL)
            grad = tl.where(x_in & term_in, grad, 0.0)
    if STRAIGHT_THROUGH:
        grad = d
    return terms, grad


@triton.jit
def _kl_fwd_kernel(
    # inputs [rows, T]
    lp_ptr, ref_ptr, mask_ptr,
    # outputs: terms [rows, T], coef [rows, T], partials [rows, col_blocks, 2] (sum l*m, sum m)
    terms_ptr, coef_ptr, partial_ptr,
    # shapes
    n_rows, seq_len, n_col_blocks,
    # code paths and tile
    KIND: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr, CLAMP: tl.constexpr,
    HAS_MASK: tl.constexpr, STORE_TERMS: tl.constexpr, STORE_GRAD: tl.constexpr,
    STORE_ROW_SUMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Per-token KL term and gradient coefficient, and per-(row, column block) sums."""
    # One grid axis (2^31 programs): a second one would cap rows or column blocks at 65535.
    pid = tl.program_id(0)
    pid_r = pid // n_col_blocks
    pid_t = pid % n_col_blocks
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    in_bounds = row_ok[:, None] & (cols < seq_len)[None, :]
    offs = rows[:, None] * seq_len + cols[None, :]

    lp = tl.load(lp_ptr + offs, mask=in_bounds, other=0.0).to(tl.float32)
    ref = tl.load(ref_ptr + offs, mask=in_bounds, other=0.0).to(tl.float32)
    terms, grad = kl_token_math(lp, ref, KIND, STRAIGHT_THROUGH, CLAMP)
    if HAS_MASK:
        m = tl.load(mask_ptr + offs, mask=in_bounds, other=0).to(tl.float32)
        keep = m != 0.0
        # A masked-out token takes 0 before the multiply: inf/NaN there never reach a sum.
        weighted = tl.where(keep, terms, 0.0) * m
        coef = tl.where(keep, grad * m, 0.0)
    else:
        m = in_bounds.to(tl.float32)
        weighted = tl.where(in_bounds, terms, 0.0)
        coef = grad
    if STORE_TERMS:
        tl.store(terms_ptr + offs, terms, mask=in_bounds)
    if STORE_GRAD:
        tl.store(coef_ptr + offs, coef.to(coef_ptr.dtype.element_ty), mask=in_bounds)
    if STORE_ROW_SUMS:
        partial = partial_ptr + (rows * n_col_blocks + pid_t) * 2
        tl.store(partial, tl.sum(weighted, axis=1), mask=row_ok)
        tl.store(partial + 1, tl.sum(m, axis=1), mask=row_ok)


def tile_shape(rows: int, seq_len: int):
    """(BLOCK_R, BLOCK_T, num_warps): a tile of up to 4096 tokens, at most 1024 columns."""
    block_t = min(next_power_of_2(max(seq_len, 1)), _MAX_BLOCK_T)
    block_r = min(max(_TILE_TOKENS // block_t, 1), next_power_of_2(max(rows, 1)))
    warps = _WARPS if block_r * block_t >= 2048 else 4
    return block_r, block_t, warps


def kl_fwd(lp, ref, mask, terms_out, coef_out, partials_out, *, kind_code, straight_through,
           clamp, block_r, block_t, num_warps):
    """Launch _kl_fwd_kernel over [rows, T]; partials_out is [rows, cdiv(T, block_t), 2]
    (empty when the row sums are not wanted); an empty terms_out / coef_out is not written."""
    rows, seq_len = lp.shape
    if rows == 0 or seq_len == 0:
        return
    n_col_blocks = triton.cdiv(seq_len, block_t)
    grid = (triton.cdiv(rows, block_r) * n_col_blocks,)
    _kl_fwd_kernel[grid](
        lp, ref, lp if mask is None else mask, terms_out, coef_out, partials_out,
        rows, seq_len, n_col_blocks,
        KIND=kind_code, STRAIGHT_THROUGH=straight_through, CLAMP=clamp,
        HAS_MASK=mask is not None, STORE_TERMS=terms_out.numel() > 0,
        STORE_GRAD=coef_out.numel() > 0, STORE_ROW_SUMS=partials_out.numel() > 0,
        BLOCK_R=block_r, BLOCK_T=block_t, num_warps=num_warps)


def kl_token_pass(lp, ref, mask, *, kind_code, straight_through, clamp, store_terms,
                  store_grad, store_row_sums, coef_dtype):
    """Allocate, launch, reduce the partials: (terms, coef, row_loss, row_count), fp32 but
    coef (``coef_dtype``), [0] when not asked for (``kl_penalty._token_pass``'s contract)."""
    import torch
    rows, seq_len = lp.shape
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)             # Triton loads bytes, not i1
    block_r, block_t, warps = tile_shape(rows, seq_len)
    new = lambda *shape: torch.empty(shape, dtype=torch.float32, device=lp.device)  # noqa
    terms = new(rows, seq_len) if store_terms else new(0)
    coef = torch.empty((rows, seq_len) if store_grad else (0,), dtype=coef_dtype,
                       device=lp.device)
    n_col_blocks = -(-seq_len // block_t)
    partials = new(rows, n_col_blocks, 2) if store_row_sums else new(0)
    kl_fwd(lp, ref, mask, terms, coef, partials, kind_code=kind_code,
           straight_through=straight_through, clamp=clamp, block_r=block_r, block_t=block_t,
           num_warps=warps)
    if not store_row_sums:
        return terms, coef, new(0), new(0)
    sums = partials.sum(1)
    return terms, coef, sums[:, 0].contiguous(), sums[:, 1].contiguous()


def _kl_aot_specs():
    # Sizes below 2^31 reach the kernel as i32: the variant a launch compiles.
    signature = {"lp_ptr": "*fp32", "ref_ptr": "*fp32", "mask_ptr": "*u8", "terms_ptr": "*fp32",
                 "coef_ptr": "*fp32", "partial_ptr": "*fp32", "n_rows": "i32", "seq_len": "i32",
                 "n_col_blocks": "i32"}
    specs = []
    for lp_dtype in ("fp32", "bf16"):
        for kind, name in ((K1, "k1"), (ABS, "abs"), (K2, "k2"), (K3, "k3")):
            for straight_through in (False, True):
                # Short responses (T <= 256) share a tile: 16 x 256; long ones 4 x 1024.
                for block_r, block_t in ((16, 256), (4, 1024)):
                    sig = dict(signature, lp_ptr=f"*{lp_dtype}", ref_ptr=f"*{lp_dtype}",
                               coef_ptr=f"*{lp_dtype}")
                    constexprs = dict(KIND=kind, STRAIGHT_THROUGH=straight_through, CLAMP=True,
                                      HAS_MASK=True, STORE_TERMS=False, STORE_GRAD=True,
                                      STORE_ROW_SUMS=True, BLOCK_R=block_r, BLOCK_T=block_t)
                    for key in constexprs:
                        sig[key] = "constexpr"
                    specs.append(AotSpec(
                        f"kl_penalty_fwd[{lp_dtype},{name}{'+' if straight_through else ''},"
                        f"{block_r}x{block_t}]", _kl_fwd_kernel, sig, constexprs,
                        num_warps=_WARPS))
    return specs


AOT_SPECS = _kl_aot_specs()
