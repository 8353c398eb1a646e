"""Plain-PyTorch Newton-Schulz: the definition, the test oracle and the CPU path.

Standard iteration on X (m x n, m <= n after an optional transpose), ||X||_F <= 1::

    X_0 = G / (||G||_F + eps)          (G^T when G has more rows than columns)
    for (a, b, c) in schedule:
        A = X X^T                                    m x m, symmetric
        B = b A + c A A                              m x m, symmetric
        X = a X + B X                                m x n

Gram iteration (same polynomial, exact arithmetic): iterate on the m x m Gram matrix and
apply the accumulated polynomial Q to X once at the end::

    R = X X^T,  Q = I
    for t, (a, b, c):
        if t is a restart:  X = Q X,  R = X X^T,  Q = I      (re-anchor on the real X)
        Z = b R + c R R                     Z is a polynomial in R
        Q = a Q + Q Z   (Q = a I + Z right after a (re)start)
        R = P R P with P = a I + Z, as W = a R + Z R, R = a W + W Z
                        (= X_{t+1} X_{t+1}^T; skipped when unused)
    X = Q X

R, Z, Q are polynomials in the same R, so Q Z and (P R) P are symmetric: the GPU kernels
compute one triangle of them. The R update stays a congruence P R P (not a symmetrized R Z):
that keeps R's small eigenvalues -- the ones the iteration inflates -- accurate.
``operand_dtype`` emulates the GPU kernels: operands of every product are rounded to it
(bf16 / fp16) and accumulated in fp32, X is stored in it between steps, the m x m matrices
(A, B, R, Z, Q) are kept in fp32. ``operand_dtype=None`` keeps everything in the working
precision (fp32, or fp64 for fp64 input): the CPU path and the exact oracle.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def gram_restarts(steps: int, every: int) -> Tuple[int, ...]:
    """Steps before which the Gram iteration re-anchors on X: every ``every`` steps."""
    if every <= 0:
        return ()
    return tuple(range(every, steps, every))


def _round(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return x if dtype is None else x.to(dtype).to(x.dtype)


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """a @ b with operands rounded to ``dtype`` and accumulated in a's working precision."""
    return _round(a, dtype) @ _round(b, dtype)


def normalize(G: torch.Tensor, eps: float, work_dtype: torch.dtype) -> Tuple[torch.Tensor, bool]:
    """X_0 = G / (||G||_F + eps) over the last two dims, wide (m <= n); returns (X_0, transposed)."""
    X = G.to(work_dtype)
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + eps)
    transposed = G.shape[-2] > G.shape[-1]
    return (X.mT if transposed else X), transposed


def standard_iterations(X: torch.Tensor, schedule: Sequence[Tuple[float, float, float]],
                        operand_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    X = _round(X, operand_dtype)
    for a, b, c in schedule:
        A = _mm(X, X.mT, operand_dtype)
        B = b * A + c * _mm(A, A, operand_dtype)
        X = _round(a * X + _mm(B, X, operand_dtype), operand_dtype)
    return X


def gram_iterations(X: torch.Tensor, schedule: Sequence[Tuple[float, float, float]],
                    restarts: Sequence[int] = (),
                    operand_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    X = _round(X, operand_dtype)
    if not schedule:
        return X
    steps = len(schedule)
    eye = torch.eye(X.shape[-2], dtype=X.dtype, device=X.device)
    R = _mm(X, X.mT, operand_dtype)
    Q = None
    for t, (a, b, c) in enumerate(schedule):
        if t in restarts and t > 0:
            X = _round(_mm(Q, X, operand_dtype), operand_dtype)
            R = _mm(X, X.mT, operand_dtype)
            Q = None
        Z = b * R + c * _mm(R, R, operand_dtype)
        Q = Z + a * eye if Q is None else a * Q + _mm(Q, Z, operand_dtype)
        if t + 1 < steps and (t + 1) not in restarts:
            W = a * R + _mm(Z, R, operand_dtype)           # P R with P = a I + Z
            R = a * W + _mm(W, Z, operand_dtype)           # (P R) P

    return _round(_mm(Q, X, operand_dtype), operand_dtype)


def newton_schulz_reference(G: torch.Tensor, schedule: Sequence[Tuple[float, float, float]], *,
                            method: str = "standard", eps: float = 1e-7,
                            restarts: Sequence[int] = (),
                            operand_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Orthogonalize the last two dims of ``G`` (any leading batch); result in ``G.dtype``.

    Works in fp64 for fp64 input, else fp32; ``schedule`` is the resolved list of (a, b, c).
    """
    if G.numel() == 0:
        return torch.zeros_like(G)
    work = torch.float64 if G.dtype == torch.float64 else torch.float32
    X, transposed = normalize(G, eps, work)
    if method == "standard":
        X = standard_iterations(X, schedule, operand_dtype)
    elif method == "gram":
        X = gram_iterations(X, schedule, restarts, operand_dtype)
    else:
        raise ValueError(f"method={method!r}: expected 'standard' or 'gram'")
    return (X.mT if transposed else X).to(G.dtype)


def head_blocks(rows_per_head: Sequence[int], num_heads: int) -> List[Tuple[int, int]]:
    """(first row, row count) of every block of a [num_heads * sum(rows), cols] matrix, in order."""
    blocks, start = [], 0
    for _ in range(num_heads):
        for r in rows_per_head:
            blocks.append((start, r))
            start += r
    return blocks


def split_orthogonalize_reference(G: torch.Tensor, num_heads: int, block_rows: Sequence[int],
                                  schedule: Sequence[Tuple[float, float, float]],
                                  **kwargs) -> torch.Tensor:
    """Each row block of every head orthogonalized on its own: a plain loop, for reading."""
    out = torch.empty_like(G)
    for start, rows in head_blocks(block_rows, num_heads):
        block = G[..., start:start + rows, :]
        out[..., start:start + rows, :] = newton_schulz_reference(block, schedule, **kwargs)
    return out
