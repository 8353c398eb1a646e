"""Batch-invariant torch primitives: each row's result is bitwise the same whatever else is in
the batch, where the row sits in it, and how the batch is chunked (``glm_kernels.batch_invariant``).

Why torch's own ops are not: a reduction over a row (``sum``, ``logsumexp``) is split across
threads depending on how many rows there are, and a matrix product picks another kernel (and
another summation order) for a single row than for a block of rows. What does hold, and what
these helpers are built from:

- elementwise ops give the same bits for an element wherever it sits (vector body or tail);
- ``amax`` is exact, so its order does not matter;
- a sum as a fixed binary tree of elementwise adds (pad the row to a power of two with zeros,
  then add its two halves until one column is left) has one order for every row;
- a matrix product on row tiles of one fixed shape: every call has the same shape, so the same
  kernel and the same order over K for every row, at every position of the tile. This holds
  for one thread count: on CPU, rollout and training must run with the same number of torch
  threads (``torch.get_num_threads()``) for their products to agree.
"""
from __future__ import annotations

import torch

from ._dispatch import batch_invariant_enabled

NEG_INF = float("-inf")
# Rows a product tile holds (the bits compare within one device, so each has its own): on CUDA
# (the fused-linear losses' cuBLAS calls) 64, a multiple of the MMA tile heights; on the CPU
# 16, so a decode step's few rows are not padded far (a hidden-512 decode 1.6x faster than
# with 64, its forward ~5-10% slower; NOTES.md). Each tile re-reads the weight.
ROW_TILE = 64
CPU_ROW_TILE = 16


def row_tile(device: torch.device) -> int:
    return CPU_ROW_TILE if device.type == "cpu" else ROW_TILE
# Product widths (N) below this get a row-major second operand (matmul_nt).
NARROW = 16


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` (the last by default) in a fixed binary tree (the same order for every
    row)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        return x.new_zeros(x.shape[:dim] + x.shape[dim + 1:])
    levels = (n - 1).bit_length()
    if n != 1 << levels:
        x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, (1 << levels) - n])
    # Each level adds the first half to the second (element i and i + width / 2): the width
    # split into ``levels`` dims of 2, the outermost unbound per level (two Python calls a
    # level; tiny rows pay per call).
    x = x.unflatten(dim, [2] * levels) if levels else x
    for _ in range(levels):
        first, second = x.unbind(dim)
        x = first + second
    return x if levels else x.select(dim, 0)


def row_shift(m: torch.Tensor) -> torch.Tensor:
    """The row max, or 0 for rows of only -inf (so e^(z - shift) is 0, not NaN)."""
    return torch.where(m == NEG_INF, 0.0, m)


def logsumexp(z: torch.Tensor) -> torch.Tensor:
    """log sum_v e^z_v over the last dim, the exp-sum as :func:`tree_sum`."""
    m = z.amax(-1)
    shift = row_shift(m)
    return shift + torch.log(tree_sum(torch.exp(z - shift.unsqueeze(-1))))


def matmul_nt(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T on tiles of exactly ``row_tile`` rows (the last one zero-padded).

    ``b`` is made row-major when it is narrow: given as the transpose of a [K, N] matrix
    (``x @ w``), x86 BLAS runs N = 5-7 and 9-11 through a kernel whose order over K depends on
    the row's place in the tile (measured; tests/invariant). Wide ones keep their layout (no
    copy of a large weight per call)."""
    m = a.shape[0]
    if b.shape[0] < NARROW and b.stride(-1) != 1:
        b = b.contiguous()
    height = row_tile(a.device)
    whole = m - m % height
    if out is None and whole == 0 and m > 0:          # a decode step: one padded tile
        return torch.mm(torch.nn.functional.pad(a, (0, 0, 0, height - m)), b.t())[:m]
    if out is None:
        out = a.new_empty((m, b.shape[0]))
    for start in range(0, whole, height):
        torch.mm(a[start:start + height], b.t(), out=out[start:start + height])
    if whole < m:
        tail = torch.nn.functional.pad(a[whole:], (0, 0, 0, height - (m - whole)))
        out[whole:].copy_(torch.mm(tail, b.t())[:m - whole])
    return out


# The torch backend's row reductions: the fixed-order ones under batch_invariant(), torch's
# (faster, thread-split) otherwise.
def row_sum(x: torch.Tensor) -> torch.Tensor:
    return tree_sum(x) if batch_invariant_enabled() else x.sum(-1)


def row_logsumexp(z: torch.Tensor) -> torch.Tensor:
    return logsumexp(z) if batch_invariant_enabled() else torch.logsumexp(z, -1)


def linear(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """a @ b^T: on fixed row tiles under batch_invariant(), else one torch.mm."""
    if batch_invariant_enabled():
        return matmul_nt(a, b, out)
    return torch.mm(a, b.t(), out=out)
