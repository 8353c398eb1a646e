"""Triton kernels of the Newton-Schulz iteration over a ragged batch of blocks.

No validation here: the caller (``ns.py``) packs every block (m x n, m <= n,
row-major) into one workspace and builds the tile tables; every launch covers all blocks,
unequal shapes included, and launches exactly one program per useful tile.

* ``_sym_product_kernel``: C = alpha * S1 S2^T + beta * D for m x m outputs known to be
  symmetric (X X^T, A A, Q Z, R Z, Z RZ). Programs exist only for lower-triangle tiles; each
  writes its tile and, off the diagonal, the mirrored tile. Optional second output
  C + shift * I (the Gram iteration's Q = Z + a I after a restart).
* ``_left_multiply_kernel``: Y = alpha * L X + beta * X (L: m x m fp32, X: m x n); the
  X <- a X + B X update, the Gram iteration's X <- Q X and its W = Z R + a R (m x m).
* ``_gram_fused_kernel``: one program per block with m <= BLOCK_M: the whole Gram iteration
  (R, Z, Q held in registers), restarts and the final Q X, in one launch.

Operands are cast to DOT_DTYPE (bf16 / fp16, fp32 accumulation); the m x m matrices stay in
fp32. UPCAST (interpreter with bf16 operands) keeps the rounded operands in fp32 for
``tl.dot``: the interpreter's ``tl.dot`` cannot multiply bf16, so it computes the same rounded
products in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._aot import AotSpec
from .._dispatch import triton_version


@triton.jit
def _round_to_bf16(x):
    """fp32 -> nearest bf16 value (ties to even), kept in fp32.

    The interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest even. This
    makes interpreted runs round like the GPU (finite values; the NS iterates are bounded).
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _operand(x, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """Round to the product dtype (UPCAST: to bf16 values held in fp32, for the interpreter)."""
    if UPCAST:
        return _round_to_bf16(x.to(tl.float32))
    else:
        return x.to(DOT_DTYPE)


@triton.jit
def _program_tile(tiles_ptr, dims_ptr, off_a_ptr, off_b_ptr):
    """This program's (block, tile row, tile col), the block's padded dims and its offsets.

    Blocks are zero-padded to multiples of 16 in both dims, block offsets are multiples of 16
    elements and the workspaces 16-byte aligned: with these hints every mask is constant over
    16 elements and every row starts aligned, so loads vectorize and the K loop pipelines
    (cp.async).
    """
    pid = tl.program_id(0)
    blk = tl.load(tiles_ptr + pid * 3)
    tile_r = tl.load(tiles_ptr + pid * 3 + 1)
    tile_c = tl.load(tiles_ptr + pid * 3 + 2)
    rows = tl.multiple_of(tl.load(dims_ptr + blk * 3), 16)
    cols = tl.multiple_of(tl.load(dims_ptr + blk * 3 + 1), 16)
    off_a = tl.multiple_of(tl.load(off_a_ptr + blk), 16)
    off_b = tl.multiple_of(tl.load(off_b_ptr + blk), 16)
    return blk, tile_r, tile_c, rows, cols, off_a, off_b


@triton.jit
def _sym_product_kernel(
    # ragged schedule: tiles [programs, 3] = (block, tile row, tile col <= tile row);
    # dims [blocks, 3] = (padded m, padded k, true m); element offsets [blocks] of each
    # block in S and in D / C
    tiles_ptr, dims_ptr, src_off_ptr, out_off_ptr,
    # S1, S2: m x k row-major (zero padding); D, C, C2: m x m row-major fp32
    s1_ptr, s2_ptr, d_ptr, out_ptr, out2_ptr,
    # runtime coefficients: C = alpha S1 S2^T + beta D;  C2 = C + shift I
    alpha, beta, shift,
    HAS_D: tl.constexpr, HAS_OUT2: tl.constexpr,
    DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Lower-triangle tile (i, j) of C = alpha * S1 S2^T + beta * D, mirrored to (j, i).

    Valid for outputs symmetric in exact arithmetic; S2 must be stored exactly symmetric when
    it stands for S2^T (every output of this kernel is).
    """
    blk, tile_i, tile_j, m, k, src, dst = _program_tile(tiles_ptr, dims_ptr, src_off_ptr,
                                                        out_off_ptr)

    rows_i = tile_i * BLOCK + tl.arange(0, BLOCK)
    rows_j = tile_j * BLOCK + tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    in_i = rows_i < m
    in_j = rows_j < m
    # int64 block offsets go into the scalar base; in-block offsets fit int32 (m * k < 2^31).
    s1_ptrs = tl.multiple_of(s1_ptr + src, 16) + rows_i[:, None] * k + offs_k[None, :]
    s2_ptrs = tl.multiple_of(s2_ptr + src, 16) + rows_j[:, None] * k + offs_k[None, :]
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        in_k = offs_k < k - k0
        a = tl.load(s1_ptrs, mask=in_i[:, None] & in_k[None, :], other=0.0)
        b = tl.load(s2_ptrs, mask=in_j[:, None] & in_k[None, :], other=0.0)
        acc = tl.dot(_operand(a, DOT_DTYPE, UPCAST), tl.trans(_operand(b, DOT_DTYPE, UPCAST)),
                     acc, input_precision=INPUT_PRECISION)
        s1_ptrs += BLOCK_K
        s2_ptrs += BLOCK_K

    c = alpha * acc
    tile = rows_i[:, None] * m + rows_j[None, :]
    mirror = rows_j[None, :] * m + rows_i[:, None]
    in_tile = in_i[:, None] & in_j[None, :]
    out_base = tl.multiple_of(out_ptr + dst, 16)
    if HAS_D:
        c += beta * tl.load(tl.multiple_of(d_ptr + dst, 16) + tile, mask=in_tile, other=0.0)
    if tile_i == tile_j:
        # The whole output is the lower triangle mirrored, diagonal tiles included: exactly
        # symmetric, so a later S1 S2^T with this S2 is S1 S2 bit for bit.
        c = tl.where(rows_i[:, None] >= rows_j[None, :], c, tl.trans(c))
    tl.store(out_base + tile, c, mask=in_tile)
    if tile_i != tile_j:
        tl.store(out_base + mirror, c, mask=in_tile)
    if HAS_OUT2:
        out2_base = tl.multiple_of(out2_ptr + dst, 16)
        if tile_i == tile_j:
            # the identity covers the block's true rows only: padding stays exactly zero
            m_true = tl.load(dims_ptr + blk * 3 + 2)
            diagonal = (rows_i[:, None] == rows_j[None, :]) & (rows_i < m_true)[:, None]
            tl.store(out2_base + tile, c + tl.where(diagonal, shift, 0.0), mask=in_tile)
        else:
            tl.store(out2_base + tile, c, mask=in_tile)
            tl.store(out2_base + mirror, c, mask=in_tile)


@triton.jit
def _left_multiply_kernel(
    # ragged schedule: tiles [programs, 3] = (block, row tile, column tile);
    # dims [blocks, 3] = (padded m, padded n, true m); element offsets [blocks] of each
    # block in X / Y and in L
    tiles_ptr, dims_ptr, x_off_ptr, l_off_ptr,
    l_ptr, x_ptr, y_ptr,
    alpha, beta,
    DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Tile of Y = alpha * L X + beta * X, stored in Y's dtype."""
    blk, tile_m, tile_n, m, n, x_off, l_off = _program_tile(tiles_ptr, dims_ptr, x_off_ptr,
                                                           l_off_ptr)

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_rows = rows < m
    in_cols = cols < n
    x_base = tl.multiple_of(x_ptr + x_off, 16)
    l_ptrs = tl.multiple_of(l_ptr + l_off, 16) + rows[:, None] * m + offs_k[None, :]
    x_ptrs = x_base + offs_k[:, None] * n + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, m, BLOCK_K):
        in_k = offs_k < m - k0
        lt = tl.load(l_ptrs, mask=in_rows[:, None] & in_k[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=in_k[:, None] & in_cols[None, :], other=0.0)
        acc = tl.dot(_operand(lt, DOT_DTYPE, UPCAST), _operand(xt, DOT_DTYPE, UPCAST), acc,
                     input_precision=INPUT_PRECISION)
        l_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * n

    tile = rows[:, None] * n + cols[None, :]
    in_tile = in_rows[:, None] & in_cols[None, :]
    y = alpha * acc
    if beta != 0.0:
        y += beta * tl.load(x_base + tile, mask=in_tile, other=0.0).to(tl.float32)
    if UPCAST:
        y = _round_to_bf16(y)
    tl.store(tl.multiple_of(y_ptr + x_off, 16) + tile, y.to(y_ptr.dtype.element_ty),
             mask=in_tile)


@triton.jit
def _gram_fused_kernel(
    # blocks [programs]: block index; dims [blocks, 3] = (padded m, padded n, true m);
    # X offsets [blocks]
    blocks_ptr, dims_ptr, x_off_ptr,
    x_ptr,                        # X (m x n per block), overwritten in place with the result
    coef_ptr, flags_ptr, steps,   # fp32 [steps, 3] = (a, b, c); int32 [steps] flag bits
    DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Whole Gram Newton-Schulz of one block with m <= BLOCK_M.

    flags bit 0: restart before this step (X <- Q X, R <- X X^T, Q <- I);
    bit 1: Q starts afresh at this step (Q = Z + a I); bit 2: update R after this step.
    """
    pid = tl.program_id(0)
    blk = tl.load(blocks_ptr + pid)
    n = tl.multiple_of(tl.load(dims_ptr + blk * 3 + 1), 16)
    m = tl.load(dims_ptr + blk * 3 + 2)
    x_base = tl.multiple_of(x_ptr + tl.load(x_off_ptr + blk), 16)

    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    in_rows = rows < m
    eye = tl.where((rows[:, None] == rows[None, :]) & in_rows[:, None], 1.0, 0.0)

    tile = rows[:, None] * n + offs_k[None, :]
    r = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, n, BLOCK_K):
        xt = tl.load(x_base + k0 + tile, mask=in_rows[:, None] & (offs_k < n - k0)[None, :],
                     other=0.0)
        xt = _operand(xt, DOT_DTYPE, UPCAST)
        r = tl.dot(xt, tl.trans(xt), r, input_precision=INPUT_PRECISION)

    q = eye
    for t in range(steps):
        a = tl.load(coef_ptr + t * 3)
        b = tl.load(coef_ptr + t * 3 + 1)
        c = tl.load(coef_ptr + t * 3 + 2)
        flags = tl.load(flags_ptr + t)
        if (flags & 1) != 0:
            # Re-anchor on the real X: X <- Q X (rounded to X's dtype), R <- X X^T of that X.
            q_op = _operand(q, DOT_DTYPE, UPCAST)
            r = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
            for k0 in range(0, n, BLOCK_K):
                ptrs = x_base + k0 + tile
                io_mask = in_rows[:, None] & (offs_k < n - k0)[None, :]
                xt = tl.load(ptrs, mask=io_mask, other=0.0)
                xn = tl.dot(q_op, _operand(xt, DOT_DTYPE, UPCAST),
                            input_precision=INPUT_PRECISION).to(xt.dtype)
                tl.store(ptrs, xn, mask=io_mask)
                xn_op = _operand(xn, DOT_DTYPE, UPCAST)
                r = tl.dot(xn_op, tl.trans(xn_op), r, input_precision=INPUT_PRECISION)
            # Other threads of this program read these columns again in the final product.
            tl.debug_barrier()
        r_op = _operand(r, DOT_DTYPE, UPCAST)
        z = b * r + c * tl.dot(r_op, r_op, input_precision=INPUT_PRECISION)
        z_op = _operand(z, DOT_DTYPE, UPCAST)
        if (flags & 2) != 0:
            q = z + a * eye
        else:
            q = a * q + tl.dot(_operand(q, DOT_DTYPE, UPCAST), z_op,
                               input_precision=INPUT_PRECISION)
        if (flags & 4) != 0:
            # R <- P R P with P = a I + Z, as (P R) P: a congruence keeps R's small
            # eigenvalues accurate (symmetrizing P R instead would not).
            w = a * r + tl.dot(z_op, r_op, input_precision=INPUT_PRECISION)
            r = a * w + tl.dot(_operand(w, DOT_DTYPE, UPCAST), z_op,
                               input_precision=INPUT_PRECISION)

    q_op = _operand(q, DOT_DTYPE, UPCAST)
    for k0 in range(0, n, BLOCK_K):
        ptrs = x_base + k0 + tile
        io_mask = in_rows[:, None] & (offs_k < n - k0)[None, :]
        xt = tl.load(ptrs, mask=io_mask, other=0.0)
        y = tl.dot(q_op, _operand(xt, DOT_DTYPE, UPCAST), input_precision=INPUT_PRECISION)
        tl.store(ptrs, y.to(xt.dtype), mask=io_mask)


# ----------------------------------------------------------------------------- launchers
def sym_block_max() -> int:
    """Largest triangle-product tile the heuristic picks on the installed Triton.

    Triton < 3.6's sm_90 code for 128 x 128 tiles with fp32 operands (S S^T + D, R R + Q)
    needs more than 255 registers a thread and spills 112-136 B to the stack (3.6 and 3.9:
    none), so triangles are tiled 64 x 64 there (4 warps, 216-220 registers, no spill).
    """
    return 128 if triton_version() >= (3, 6) else 64


def sym_product(tiles, dims, src_off, out_off, s1, s2, d, out, out2, *, alpha, beta, shift,
                dot_dtype, upcast, input_precision, block, block_k, num_warps, num_stages):
    """Launch one program per row of ``tiles`` (None for d / out2 switches them off)."""
    _sym_product_kernel[(tiles.shape[0],)](
        tiles, dims, src_off, out_off, s1, s2, out if d is None else d, out,
        out if out2 is None else out2, alpha, beta, shift,
        HAS_D=d is not None, HAS_OUT2=out2 is not None, DOT_DTYPE=dot_dtype, UPCAST=upcast,
        INPUT_PRECISION=input_precision, BLOCK=block, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages)


def left_multiply(tiles, dims, x_off, l_off, lhs, x, y, *, alpha, beta, dot_dtype, upcast,
                  input_precision, block_m, block_n, block_k, num_warps, num_stages):
    _left_multiply_kernel[(tiles.shape[0],)](
        tiles, dims, x_off, l_off, lhs, x, y, alpha, beta, DOT_DTYPE=dot_dtype, UPCAST=upcast,
        INPUT_PRECISION=input_precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)


def gram_fused(blocks, dims, x_off, x, coefs, flags, *, dot_dtype, upcast, input_precision,
               block_m, block_k, num_warps, num_stages):
    _gram_fused_kernel[(blocks.shape[0],)](
        blocks, dims, x_off, x, coefs, flags, coefs.shape[0], DOT_DTYPE=dot_dtype,
        UPCAST=upcast, INPUT_PRECISION=input_precision, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- AOT specs
def _muon_aot_specs():
    """Every configuration the GPU path launches (ns._resolve's choices)."""
    specs = []
    table = {"tiles_ptr": "*i32", "dims_ptr": "*i32"}
    for op_name, op_dtype in (("bf16", tl.bfloat16), ("fp16", tl.float16)):
        for block, block_k, warps in ((128, 64, 8), (64, 64, 4)):
            for src, has_d, has_out2 in (("x", False, False), ("mm", True, False),
                                         ("mm", True, True)):
                if op_name == "bf16" and has_out2:
                    continue                      # the standard method never writes C2
                if block > sym_block_max():
                    continue                      # not launched on this Triton
                s_type = f"*{op_name}" if src == "x" else "*fp32"
                sig = dict(table, src_off_ptr="*i64", out_off_ptr="*i64", s1_ptr=s_type,
                           s2_ptr=s_type, d_ptr="*fp32", out_ptr="*fp32", out2_ptr="*fp32",
                           alpha="fp32", beta="fp32", shift="fp32")
                const = dict(HAS_D=has_d, HAS_OUT2=has_out2, DOT_DTYPE=op_dtype, UPCAST=False,
                             INPUT_PRECISION="tf32", BLOCK=block, BLOCK_K=block_k)
                sig.update({name: "constexpr" for name in const})
                label = "XXt" if src == "x" else ("RR+Q" if has_out2 else "SSt+D")
                specs.append(AotSpec(f"muon_sym[{op_name},{label},{block}x{block_k}]",
                                     _sym_product_kernel, sig, const, num_warps=warps,
                                     num_stages=3, expects_hgmma=True))
            sig = dict(table, x_off_ptr="*i64", l_off_ptr="*i64", l_ptr="*fp32",
                       x_ptr=f"*{op_name}", y_ptr=f"*{op_name}", alpha="fp32", beta="fp32")
            const = dict(DOT_DTYPE=op_dtype, UPCAST=False, INPUT_PRECISION="tf32",
                         BLOCK_M=block, BLOCK_N=128, BLOCK_K=block_k)
            sig.update({name: "constexpr" for name in const})
            specs.append(AotSpec(f"muon_left_mul[{op_name},{block}x128x{block_k}]",
                                 _left_multiply_kernel, sig, const, num_warps=warps,
                                 num_stages=3, expects_hgmma=True))
            if op_name == "fp16":                 # gram: W = Z R + a R, all fp32 m x m
                sig = dict(sig, x_ptr="*fp32", y_ptr="*fp32")
                const = dict(const, BLOCK_N=block)
                specs.append(AotSpec(f"muon_left_mul[fp16,ZR+aR,{block}x{block}x{block_k}]",
                                     _left_multiply_kernel, sig, const, num_warps=warps,
                                     num_stages=3, expects_hgmma=True))
    for block_m in (64,):
        sig = {"blocks_ptr": "*i32", "dims_ptr": "*i32", "x_off_ptr": "*i64", "x_ptr": "*fp16",
               "coef_ptr": "*fp32", "flags_ptr": "*i32", "steps": "i32"}
        const = dict(DOT_DTYPE=tl.float16, UPCAST=False, INPUT_PRECISION="tf32",
                     BLOCK_M=block_m, BLOCK_K=64)
        sig.update({name: "constexpr" for name in const})
        specs.append(AotSpec(f"muon_gram_fused[fp16,m<={block_m}]", _gram_fused_kernel, sig,
                             const, num_warps=4, num_stages=2, expects_hgmma=True))
    return specs


AOT_SPECS = _muon_aot_specs()
