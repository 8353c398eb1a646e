"""Batched Newton-Schulz orthogonalization over a ragged batch of blocks.

Math (readable version in ``muon/_reference.py``): X_0 = G / (||G||_F + eps) (transposed when
G has more rows than columns, so X is m x n with m <= n); each step applies
X <- a X + (b A + c A^2) X with A = X X^T, i.e. the odd quintic a x + b x^3 + c x^5 to every
singular value. ``method="gram"`` computes the same polynomial by iterating on the m x m Gram
matrix R = X X^T and applying the accumulated Q to X at the end (restarts every
``NSConfig.restart_every`` steps re-anchor R on the real X).

GPU path (``_kernels.py``): every block of every source is packed into one workspace
(m, n zero-padded to multiples of 16), and each matrix product of a step is ONE launch over all
blocks, unequal shapes included, with one program per useful tile: symmetric products
(X X^T, A A, Q Z, ...) launch lower-triangle tiles only and mirror them. Products use bf16
operands (``standard``) or fp16 operands (``gram``: squaring the spectrum needs the extra
mantissa bits; the normalized magnitudes stay far inside fp16 range) with fp32 accumulation;
the m x m matrices are kept in fp32. Gram blocks with m <= 64 run the whole iteration in one
program each (``_gram_fused_kernel``).
"""

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import _checks, _dispatch
from . import _reference
from .coefficients import Coefficients, resolve_coefficients

METHODS = ("standard", "gram")
_PAD = 16                      # block dims and offsets are multiples of this (kernel hints)
_LARGE_M = 512                 # blocks with more rows (after transposing) use 128-row tiles
_OPERAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class NSConfig:
    """Tuning knobs of the Triton path; ``None`` / 0 picks the heuristic default.

    operand_dtype: dtype of matrix-product operands (accumulation is fp32). Default bf16 for
        ``standard``, fp16 for ``gram``. fp32 runs exact fp32 products (slow; for tests).
    restart_every: ``gram`` re-anchors on X before steps restart_every, 2*restart_every, ...
        (3: one restart in a 5-step schedule). 0 disables restarts.
    block: tile of the symmetric (triangle-only) products; smaller tiles skip more of the
        upper triangle (m = 256: 10/16 tiles at 64, 3/4 at 128).
    block_m, block_n, block_k: row, column and reduction tiles of the left multiplications.
    fused_max_m: ``gram`` blocks with at most this many rows (<= 64) run the
        one-program-per-block kernel (0 disables it).
    num_warps, num_stages: launch options (0: 4 warps per 64-row tile, 8 per 128; 3 stages).
    """
    operand_dtype: Optional[torch.dtype] = None
    restart_every: int = 3
    block: int = 0
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    fused_max_m: int = 64
    num_warps: int = 0
    num_stages: int = 0

    def __post_init__(self):
        if self.operand_dtype is not None and self.operand_dtype not in _OPERAND_DTYPES:
            raise ValueError(f"NSConfig.operand_dtype must be one of {_OPERAND_DTYPES} or None, "
                             f"got {self.operand_dtype}")
        for name in ("restart_every", "block", "block_m", "block_n", "block_k", "fused_max_m",
                     "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"NSConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("block", "block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value and (value < 16 or value & (value - 1)):
                raise ValueError(f"NSConfig.{name} must be 0 or a power of two >= 16, "
                                 f"got {value}")


@dataclass(frozen=True)
class _Launch:
    """The resolved configuration of one call."""
    operand_dtype: torch.dtype
    restarts: Tuple[int, ...]
    block: int
    block_m: int
    block_n: int
    block_k: int
    fused_max_m: int
    sym_warps: int
    left_warps: int
    num_stages: int


def _resolve(config: NSConfig, method: str, steps: int, ms: Sequence[int],
             interpret: bool, sym_block_max: int) -> _Launch:
    """``sym_block_max``: the largest triangle tile the heuristic may pick on this Triton
    (``_kernels.sym_block_max``); an explicit ``config.block`` stands."""
    operand = config.operand_dtype or (torch.float16 if method == "gram" else torch.bfloat16)
    if interpret:
        # The interpreter runs every program in numpy (a fixed cost per operation): few,
        # mid-sized tiles keep tests fast; blocks past 32 rows still span several tiles.
        block, block_m, block_n, block_k = 32, 32, 64, 32
    else:
        # Triangle products: 64-row tiles skip more of the upper triangle for per-head
        # blocks (m <= 512); left products: 128-row tiles once every block has 128 rows.
        padded = [_ceil(m, _PAD) for m in ms] or [128]
        block = min(128 if max(padded) > _LARGE_M else 64, sym_block_max)
        block_m = 128 if min(padded) >= 128 else 64
        block_n, block_k = 128, 64
    block, block_m = config.block or block, config.block_m or block_m
    warps = lambda tile: config.num_warps or (8 if tile >= 128 else 4)   # noqa: E731
    return _Launch(
        operand_dtype=operand,
        restarts=_reference.gram_restarts(steps, config.restart_every) if method == "gram"
        else (),
        block=block, block_m=block_m, block_n=config.block_n or block_n,
        block_k=config.block_k or block_k,
        fused_max_m=min(config.fused_max_m, 64) if method == "gram" else 0,
        sym_warps=warps(block), left_warps=warps(block_m),
        num_stages=config.num_stages or 3)


def _ceil(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# --------------------------------------------------------------------------- block layout
@dataclass
class _Plan:
    """Workspace layout and tile tables for one set of block shapes (cached per device)."""
    x_numel: int
    a_numel: int
    source_x_offsets: List[int]       # first element of each source's blocks in X
    tiled: Optional[dict]             # tensors for the tiled kernels (None: no such blocks)
    fused: Optional[dict]             # tensors for the fused Gram kernel
    fused_sources: Tuple[bool, ...]   # per source: handled by the fused kernel


def _tables(blocks, block, block_m, block_n, device):
    """Tile tables for blocks = [(m_pad, n_pad, m_true, x_off, a_off)], heaviest first."""
    order = sorted(range(len(blocks)), key=lambda b: -blocks[b][0] * blocks[b][1])
    sym, left, left_sq = [], [], []
    for b in order:
        m_pad, n_pad = blocks[b][0], blocks[b][1]
        tiles = -(-m_pad // block)
        rows = -(-m_pad // block_m)
        sym += [(b, i, j) for i in range(tiles) for j in range(i + 1)]
        left += [(b, i, j) for i in range(rows) for j in range(-(-n_pad // block_n))]
        left_sq += [(b, i, j) for i in range(rows) for j in range(rows)]
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return {
        "sym_tiles": torch.tensor(sym, **i32).reshape(-1, 3),
        "left_tiles": torch.tensor(left, **i32).reshape(-1, 3),
        "left_sq_tiles": torch.tensor(left_sq, **i32).reshape(-1, 3),
        "dims_x": torch.tensor([(m, n, mt) for m, n, mt, _, _ in blocks], **i32).reshape(-1, 3),
        "dims_a": torch.tensor([(m, m, mt) for m, _, mt, _, _ in blocks], **i32).reshape(-1, 3),
        "x_off": torch.tensor([x for *_, x, _ in blocks], **i64),
        "a_off": torch.tensor([a for *_, a in blocks], **i64),
        "block_ids": torch.arange(len(blocks), **i32),
    }


@functools.lru_cache(maxsize=64)
def _plan(shapes: Tuple[Tuple[int, int, int], ...], block: int, block_m: int, block_n: int,
          fused_max_m: int, device: torch.device) -> _Plan:
    """shapes: (count, m, n) per source with m <= n."""
    x_off = a_off = 0
    tiled, fused, source_x, fused_sources = [], [], [], []
    for count, m, n in shapes:
        m_pad, n_pad = _ceil(m, _PAD), _ceil(n, _PAD)
        if m_pad * n_pad >= 2 ** 31:
            raise ValueError(f"newton_schulz: a {m} x {n} block has more than 2^31 elements "
                             "(the kernels index within a block in int32)")
        in_fused = 0 < m <= fused_max_m
        fused_sources.append(in_fused)
        source_x.append(x_off)
        for _ in range(count):
            (fused if in_fused else tiled).append((m_pad, n_pad, m, x_off, a_off))
            x_off += m_pad * n_pad
            if not in_fused:
                a_off += m_pad * m_pad
    return _Plan(x_off, a_off, source_x,
                 _tables(tiled, block, block_m, block_n, device) if tiled else None,
                 _tables(fused, block, block_m, block_n, device) if fused else None,
                 tuple(fused_sources))


# --------------------------------------------------------------------------- the engine
def _workspace(shape, dtype, device) -> torch.Tensor:
    """Every uninitialized buffer of this module (tests fill them with NaN: poison)."""
    return torch.empty(shape, dtype=dtype, device=device)


def orthogonalize(sources: Sequence[torch.Tensor], schedule: Sequence[Tuple[float, float, float]],
                  *, method: str, eps: float, config: NSConfig, backend: str
                  ) -> List[torch.Tensor]:
    """NS of every [count, r, c] block of every source; returns one [count, r, c] view each.

    The returned tensors may be views into a workspace in the operand dtype (GPU path) or
    fp32 tensors (torch path); callers copy or accumulate them (``out.copy_(view)``,
    ``p.add_(view, alpha=...)``). Sources are only read.
    """
    if backend == "torch":
        out = []
        for src in sources:
            X, transposed = _reference.normalize(src, eps, torch.float32)
            if method == "standard":
                X = _reference.standard_iterations(X, schedule)
            else:
                restarts = _reference.gram_restarts(len(schedule), config.restart_every)
                X = _reference.gram_iterations(X, schedule, restarts)
            out.append(X.mT if transposed else X)
        return out
    # Per-head blocks and whole matrices want different tiles (64-row triangles for short
    # reductions, 128-row tiles for big ones): one batched call per size class.
    classes: Dict[bool, List[int]] = {}
    for i, src in enumerate(sources):
        classes.setdefault(min(src.shape[-2:]) > _LARGE_M, []).append(i)
    results: List[Optional[torch.Tensor]] = [None] * len(sources)
    for members in classes.values():
        outs = _orthogonalize_triton([sources[i] for i in members], schedule, method, eps,
                                     config, interpret=backend == "interpret")
        for i, out in zip(members, outs):
            results[i] = out
    return results


def _pack(sources, plan, shapes, eps, storage):
    """X_0 of every block into a fresh workspace (zero padding), one norm per block."""
    device = sources[0].device
    ws = _workspace((plan.x_numel,), storage, device)
    for src, (count, m, n), x_off in zip(sources, shapes, plan.source_x_offsets):
        m_pad, n_pad = _ceil(m, _PAD), _ceil(n, _PAD)
        view = ws[x_off:x_off + count * m_pad * n_pad].view(count, m_pad, n_pad)
        if m_pad > m:
            view[:, m:, :].zero_()
        if n_pad > n:
            view[:, :m, n:].zero_()
        norm = torch.linalg.vector_norm(src, dim=(-2, -1), keepdim=True, dtype=torch.float32)
        target = view[:, :m, :n]
        torch.div(src, norm + eps, out=target.mT if src.shape[-2] > src.shape[-1] else target)
    return ws


def _unpacked(ws, sources, plan, shapes):
    views = []
    for src, (count, m, n), x_off in zip(sources, shapes, plan.source_x_offsets):
        m_pad, n_pad = _ceil(m, _PAD), _ceil(n, _PAD)
        view = ws[x_off:x_off + count * m_pad * n_pad].view(count, m_pad, n_pad)[:, :m, :n]
        views.append(view.mT if src.shape[-2] > src.shape[-1] else view)
    return views


def _orthogonalize_triton(sources, schedule, method, eps, config, interpret):
    from . import _kernels
    import triton.language as tl

    shapes = tuple((s.shape[0], min(s.shape[-2:]), max(s.shape[-2:])) for s in sources)
    run = _resolve(config, method, len(schedule), [m for _, m, _ in shapes], interpret,
                   _kernels.sym_block_max())
    plan = _plan(shapes, run.block, run.block_m, run.block_n, run.fused_max_m,
                 sources[0].device)
    storage = run.operand_dtype
    packed = _pack(sources, plan, shapes, eps, storage)
    if not schedule:
        return _unpacked(packed, sources, plan, shapes)

    dot_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                 torch.float32: tl.float32}[storage]
    opts = dict(dot_dtype=dot_dtype, upcast=interpret and storage == torch.bfloat16,
                input_precision="ieee" if storage == torch.float32 else "tf32",
                num_stages=run.num_stages)
    if plan.fused is not None:
        # In place on the packed workspace; the tiled launches never touch these blocks.
        fused_m = max(m for (_, m, _), f in zip(shapes, plan.fused_sources) if f)
        block_m = max(16, 1 << (fused_m - 1).bit_length()) if interpret else 64
        coefs, flags = _fused_schedule(tuple(schedule), run.restarts, packed.device)
        _kernels.gram_fused(plan.fused["block_ids"], plan.fused["dims_x"],
                            plan.fused["x_off"], packed, coefs, flags,
                            block_m=block_m, block_k=run.block_k, num_warps=4, **opts)
    final = packed
    if plan.tiled is not None:
        final = _run_tiled(_kernels, plan, packed, schedule, method, run, opts)
    return [f if fused else t for f, t, fused in zip(
        _unpacked(packed, sources, plan, shapes), _unpacked(final, sources, plan, shapes),
        plan.fused_sources)]


@functools.lru_cache(maxsize=64)
def _fused_schedule(schedule: Tuple[Tuple[float, float, float], ...], restarts: Tuple[int, ...],
                    device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Device copies (made once) of the coefficients [steps, 3] and the per-step flags:
    bit 0 restart before the step, bit 1 Q starts afresh, bit 2 update R after it."""
    steps = len(schedule)
    flags = [(1 if (s in restarts and s > 0) else 0)
             | (2 if (s == 0 or s in restarts) else 0)
             | (4 if (s + 1 < steps and (s + 1) not in restarts) else 0) for s in range(steps)]
    return (torch.tensor(schedule, dtype=torch.float32, device=device),
            torch.tensor(flags, dtype=torch.int32, device=device))


def _run_tiled(_kernels, plan, x, schedule, method, run, opts):
    """Every step as a few launches over all tiled blocks; returns the buffer holding X_T."""
    t = plan.tiled
    sym_opts = dict(opts, block=run.block, block_k=run.block_k, num_warps=run.sym_warps)
    left_opts = dict(opts, block_m=run.block_m, block_n=run.block_n, block_k=run.block_k,
                     num_warps=run.left_warps)

    def sym(s1, s2, out, *, square, d=None, out2=None, alpha=1.0, beta=0.0, shift=0.0):
        """out = alpha s1 s2^T + beta d (+ out2 = out + shift I); s = X (m x n) or m x m."""
        dims, src = (t["dims_a"], t["a_off"]) if square else (t["dims_x"], t["x_off"])
        _kernels.sym_product(t["sym_tiles"], dims, src, t["a_off"], s1, s2, d, out, out2,
                             alpha=alpha, beta=beta, shift=shift, **sym_opts)

    def left(lhs, xin, xout, *, beta=0.0):
        """xout = lhs xin + beta xin (xin: m x n)."""
        _kernels.left_multiply(t["left_tiles"], t["dims_x"], t["x_off"], t["a_off"], lhs, xin,
                               xout, alpha=1.0, beta=beta, **left_opts)

    def left_square(lhs, xin, xout, *, beta=0.0):
        """xout = lhs xin + beta xin (xin: m x m fp32)."""
        _kernels.left_multiply(t["left_sq_tiles"], t["dims_a"], t["a_off"], t["a_off"], lhs,
                               xin, xout, alpha=1.0, beta=beta,
                               **dict(left_opts, block_n=run.block_m))

    x_next = _workspace(x.shape, x.dtype, x.device)
    mats = _workspace((5 if method == "gram" else 2, plan.a_numel), torch.float32, x.device)
    if method == "standard":
        A, B = mats
        for a, b, c in schedule:
            sym(x, x, A, square=False)
            sym(A, A, B, square=True, d=A, alpha=c, beta=b)
            left(B, x, x_next, beta=a)
            x, x_next = x_next, x
        return x
    R, Z, W, Q, Q_next = mats
    steps = len(schedule)
    sym(x, x, R, square=False)
    for step, (a, b, c) in enumerate(schedule):
        restart = step in run.restarts and step > 0
        if restart:
            left(Q, x, x_next)
            x, x_next = x_next, x
            sym(x, x, R, square=False)
        if step == 0 or restart:
            sym(R, R, Z, square=True, d=R, out2=Q, alpha=c, beta=b, shift=a)
        else:
            sym(R, R, Z, square=True, d=R, alpha=c, beta=b)
            sym(Q, Z, Q_next, square=True, d=Q, beta=a)
            Q, Q_next = Q_next, Q
        if step + 1 < steps and (step + 1) not in run.restarts:
            left_square(Z, R, W, beta=a)                    # W = P R (full product)
            sym(W, Z, R, square=True, d=W, beta=a)          # R = W P (symmetric)
    left(Q, x, x_next)
    return x_next


# --------------------------------------------------------------------------- public op
def head_block_views(G: torch.Tensor, num_heads: int, block_rows: Sequence[int]
                     ) -> List[torch.Tensor]:
    """[batch * num_heads, r_j, cols] views of every block part j of a [*, H * sum(r), cols] G."""
    rows_per_head = sum(block_rows)
    grouped = G.reshape(-1, num_heads, rows_per_head, G.shape[-1])
    views, start = [], 0
    for rows in block_rows:
        part = grouped[:, :, start:start + rows, :]
        views.append(part.reshape(-1, rows, G.shape[-1]))
        start += rows
    return views


def _orthogonalize_split(G, num_heads, block_rows, schedule, method, eps, config):
    backend = _dispatch.select_backend("newton_schulz", G)
    out = _workspace(G.shape, G.dtype, G.device)
    if G.numel() == 0:
        return out
    G = G.contiguous()
    sources = head_block_views(G, num_heads, block_rows)
    results = orthogonalize(sources, schedule, method=method, eps=eps, config=config,
                            backend=backend)
    for target, result in zip(head_block_views(out, num_heads, block_rows), results):
        target.copy_(result)
    return out


def _config_args(config: NSConfig):
    return (config.restart_every, config.operand_dtype,
            [config.block, config.block_m, config.block_n, config.block_k, config.fused_max_m,
             config.num_warps, config.num_stages])


def _config_from_args(restart_every, operand_dtype, tiles) -> NSConfig:
    return NSConfig(operand_dtype, restart_every, *tiles)


@torch.library.custom_op("glm_kernels::muon_orthogonalize", mutates_args=())
def _orthogonalize_op(G: torch.Tensor, num_heads: int, block_rows: List[int],
                      coefficients: List[float], method: str, eps: float, restart_every: int,
                      operand_dtype: Optional[torch.dtype], tiles: List[int]) -> torch.Tensor:
    """Newton-Schulz of every row block of every head; coefficients flat [steps * 3]."""
    schedule = [tuple(coefficients[i:i + 3]) for i in range(0, len(coefficients), 3)]
    return _orthogonalize_split(G, num_heads, block_rows, schedule, method, eps,
                                _config_from_args(restart_every, operand_dtype, tiles))


@_orthogonalize_op.register_fake
def _orthogonalize_fake(G, num_heads, block_rows, coefficients, method, eps, restart_every,
                        operand_dtype, tiles):
    # contiguous like the real op's output (empty_like would keep a transposed G's strides)
    return G.new_empty(G.shape)


def run_orthogonalize(G: torch.Tensor, num_heads: int, block_rows: Sequence[int], steps: int,
                      coefficients: Coefficients, method: str, eps: float,
                      config: Optional[NSConfig]) -> torch.Tensor:
    """Validated entry shared by newton_schulz and muon_split_orthogonalize."""
    schedule = resolve_coefficients(coefficients, steps)
    _checks.check_choice("method", method, METHODS)
    eps = _checks.check_finite_number("eps", eps, nonnegative=True)
    config = NSConfig() if config is None else config
    if not isinstance(config, NSConfig):
        raise TypeError(f"config must be an NSConfig or None, got {type(config).__name__}")
    if torch.compiler.is_compiling():
        flat = [v for entry in schedule for v in entry]
        return _orthogonalize_op(G, num_heads, list(block_rows), flat, method, eps,
                                 *_config_args(config))
    # Eager: skip the dispatcher (its overhead is tens of microseconds per call).
    return _orthogonalize_split(G, num_heads, list(block_rows), schedule, method, eps, config)


def newton_schulz(G: torch.Tensor, steps: int = 5, *, coefficients: Coefficients = "jordan",
                  method: str = "standard", eps: float = 1e-7,
                  config: Optional[NSConfig] = None) -> torch.Tensor:
    """Orthogonalize the last two dims of ``G`` by Newton-Schulz, batched over the rest.

    Parameters
    ----------
    G : Tensor [*, rows, cols], float32 / bfloat16 / float16 / float64
        Any leading batch shape; every [rows, cols] matrix is orthogonalized on its own.
    steps : int, default 5
        Number of quintic steps (0 returns the normalized input).
    coefficients : "jordan" | "polar_express" | list of (a, b, c)
        Per-step coefficients (see ``glm_kernels.muon.coefficients``): "jordan" is
        (3.4445, -4.7750, 2.0315) every step; "polar_express" the per-step minimax schedule of
        Amsel et al. 2025; a list gives step t entry t (the last entry repeats).
    method : {"standard", "gram"}
        "standard": X <- a X + (b A + c A^2) X with A = X X^T each step. "gram": iterate on
        the min(rows, cols)^2 Gram matrix and apply the accumulated polynomial once (fewer
        FLOPs when rows << cols), restarting every ``config.restart_every`` steps.
    eps : float, default 1e-7
        X_0 = G / (||G||_F + eps).
    config : NSConfig, optional
        Tile sizes, operand dtype and restarts of the Triton path (heuristic by default).

    Returns
    -------
    Tensor with the shape and dtype of ``G``: approximately U V^T for G = U S V^T; its singular
    values lie in the band of the schedule (``coefficients.singular_value_band``), about
    [0.68, 1.13] for jordan and [0.85, 1.12] for polar_express after 5 steps.

    Notes
    -----
    Math: a x + b x^3 + c x^5 applied ``steps`` times to every singular value of
    X_0 (X_0 is G^T when rows > cols, so the products are min(rows, cols)^2). On GPU the
    products use bf16 (standard) or fp16 (gram) operands with fp32 accumulation; the CPU
    (torch) path computes in fp32. A NaN or inf in a matrix makes that matrix's result NaN.

    Example
    -------
    >>> import torch, glm_kernels
    >>> from glm_kernels.muon import newton_schulz
    >>> G = torch.randn(4, 32, 96)
    >>> O = newton_schulz(G, coefficients="polar_express")
    >>> s = torch.linalg.svdvals(O)
    >>> bool((s > 0.8).all() and (s < 1.2).all())
    True
    """
    _checks.check_tensor("G", G, floating=True)
    if G.dim() < 2:
        raise ValueError(f"G must have at least 2 dims [*, rows, cols], got shape "
                         f"{tuple(G.shape)}")
    return run_orthogonalize(G, 1, [G.shape[-2]], steps, coefficients, method, eps, config)
