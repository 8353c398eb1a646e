"""Deterministic top-k: exactly the first k of ``torch.sort(x, dim, descending, stable=True)``.

Math (docs/design.md 3.6; readable version in ``topk/_reference.py``): rank the entries of each
row by value in sort order (NaN above +inf, -0.0 == +0.0) and, among equal values, by
ascending index; return the first k. ``sorted=False`` returns the same set in ascending
index order. ``lengths`` keeps only the first lengths[i] entries of row i.

Two Triton paths:

* short rows (<= ``SHORT_MAX`` entries, keys of at most 32 bits; ``_kernels.py``): a few
  rows per program in registers; each entry becomes the 64-bit key
  ``order_key << 32 | (0xFFFFFFFF - index)`` and a bitonic top-k network keeps the k largest.
* long rows, and 64-bit dtypes: radix select (``_radix_kernels.py``). 8-bit digit
  histogram passes over the row narrow the k-th key to one bin; once that bin fits a
  candidate buffer (8192 entries) a filter pass takes everything above it and copies the bin
  to the buffer, where the remaining digit passes and the tie cut (lowest indices, counted
  with prefix sums, no atomics) run. Typical rows are read twice. The k packed keys are
  then sorted in registers. For 64-bit dtypes or k > ``SORT_IN_KERNEL_MAX`` the kernel
  makes every digit pass over the row, writes the set in index order, and a
  ``torch.sort(stable=True)`` of those k values orders it.

Every step is a fixed function of the row, so results are bitwise identical across runs,
batch sizes and backends; values are the input elements' own bits.
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from .. import _checks, _dispatch
from .._launch import sm_count
from . import _reference
from ._radix_launch import radix_wide_tile

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
                    torch.int64)
KEY_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.int32: 32,
            torch.float64: 64, torch.int64: 64}
METHODS = ("short", "radix")
SHORT_MAX = 4096               # longest row the register (short) path takes
SORT_IN_KERNEL_MAX = 4096      # largest k the radix path sorts in registers
MAX_ROW = 2 ** 31 - 2 ** 16    # in-row offsets are int32 (tiles may run past the end)


class TopK(NamedTuple):
    values: torch.Tensor
    indices: torch.Tensor


@dataclass(frozen=True)
class TopkConfig:
    """Launch configuration. ``make_topk_config`` picks one; pass your own to override.

    method: "short" (rows in registers, keys <= 32 bits) or "radix" (any row length).
    rows_per_program: rows per program of the short path (power of two).
    tile: entries per loop step of the radix path (power of two).
    radix_bits: digit width of the radix histogram passes (1..11).
    candidates: capacity of the radix path's candidate buffer per program (power of two);
        digit passes over the whole row stop once the k-th key's bin fits in it.
    programs: radix-path programs (persistent grid; 0 = one per row); scratch memory is
        programs x (candidates + next_pow2(k)) int64.
    """
    method: str
    rows_per_program: int = 1
    tile: int = 2048
    radix_bits: int = 8
    candidates: int = 8192
    programs: int = 0
    num_warps: int = 8


_next_pow2 = _dispatch.next_power_of_2


def make_topk_config(n_cols: int, k: int, n_rows: int, dtype: torch.dtype, *,
                     interpret: bool = False, device: Optional[torch.device] = None
                     ) -> TopkConfig:
    """Heuristic: registers for short rows of <= 32-bit keys, radix select otherwise.

    ``device`` (CUDA) sizes the persistent radix grid by its SM count; ``interpret`` picks
    small tiles and buffers so the interpreter exercises every path on small rows.
    """
    _checks.check_bool("interpret", interpret)
    if KEY_BITS[dtype] <= 32 and n_cols <= SHORT_MAX:
        block = _next_pow2(n_cols)
        rows = max(1, min(_next_pow2(n_rows), 2048 // block))
        return TopkConfig("short", rows_per_program=rows,
                          num_warps=4 if rows * block <= 2048 else 8)
    if interpret:
        return TopkConfig("radix", tile=256, candidates=256, programs=0, num_warps=8)
    sms = (132 if device is None else
           sm_count(device.index) if device.type == "cuda" else 1)
    few_rows = n_rows < sms                  # one program per SM: widen it
    # Two 8-warp programs fit on an SM (~90 registers a thread); more rows share programs.
    # 8192 candidates (64 KB a program, L2-resident): the first digit's bin holding the
    # top 1% of a 200K row of normal scores has ~4.5K entries.
    direct = KEY_BITS[dtype] > 32 or k > SORT_IN_KERNEL_MAX
    return TopkConfig("radix", tile=radix_wide_tile(direct) if few_rows else 2048,
                      candidates=8192,
                      programs=min(n_rows, 2 * sms),
                      num_warps=16 if few_rows or _next_pow2(k) >= 4096 else 8)


def _check_config(config: TopkConfig, dtype: torch.dtype) -> None:
    if not isinstance(config, TopkConfig):
        raise TypeError(f"config must be a TopkConfig, got {type(config).__name__}")
    _checks.check_choice("config.method", config.method, METHODS)
    for name in ("rows_per_program", "tile", "candidates"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two, got {value}")
    if not 1 <= config.radix_bits <= 11:
        raise ValueError(f"config.radix_bits must be in [1, 11], got {config.radix_bits}")
    if config.programs < 0:
        raise ValueError(f"config.programs must be >= 0, got {config.programs}")
    if config.method == "short" and KEY_BITS[dtype] > 32:
        raise ValueError(f"config.method='short' needs keys of at most 32 bits; dtype {dtype} "
                         "takes the 'radix' method")


def _topk_rows(x2d: torch.Tensor, k: int, largest: bool, sorted: bool,
               lengths: Optional[torch.Tensor], method: str, rows_per_program: int, tile: int,
               radix_bits: int, candidates: int, programs: int, num_warps: int
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k along dim 1 of a 2-D tensor whose rows are contiguous."""
    n_rows, n_cols = x2d.shape
    backend = _dispatch.select_backend("topk", x2d, lengths)
    if backend == "torch" or n_rows == 0 or k == 0:
        return _reference.topk_reference(x2d, k, 1, largest, sorted, lengths)
    device = x2d.device
    values = torch.empty((n_rows, k), dtype=x2d.dtype, device=device)
    indices = torch.empty((n_rows, k), dtype=torch.int64, device=device)
    key_bits = KEY_BITS[x2d.dtype]
    common = dict(k=k, fill=_reference.fill_value(x2d.dtype, largest), is_float=x2d.is_floating_point(),
                  key_bits=key_bits, largest=largest, sorted=sorted, num_warps=num_warps)
    if method == "short":
        from . import _kernels
        _kernels.topk_short(x2d, lengths, values, indices, rows_per_program=rows_per_program,
                            block=_next_pow2(n_cols), **common)
        return values, indices
    from . import _radix_kernels
    direct = key_bits > 32 or k > SORT_IN_KERNEL_MAX
    programs = min(programs or n_rows, n_rows)
    if direct:
        scratch = candidates_buffer = torch.empty((programs, 1), dtype=torch.int64,
                                                  device=device)
    else:
        scratch = torch.empty((programs, _next_pow2(k)), dtype=torch.int64, device=device)
        candidates_buffer = torch.empty((programs, candidates), dtype=torch.int64,
                                        device=device)
    _radix_kernels.topk_radix(x2d, lengths, values, indices, scratch, candidates_buffer,
                              direct=direct, radix_bits=radix_bits, tile=tile, **common)
    if direct and sorted:
        # The set is in index order, so a stable sort of its values is the contract order;
        # empty slots (index -1) are sorted last explicitly (a NaN would pass a +inf fill).
        order = _reference.stable_order(values, largest, excluded=indices < 0)
        values, indices = _reference.take_bits(values, order, 1), indices.gather(1, order)
    return values, indices


@torch.library.custom_op("glm_kernels::topk", mutates_args=())
def _topk_op(x2d: torch.Tensor, k: int, largest: bool, sorted: bool,
             lengths: Optional[torch.Tensor], method: str, rows_per_program: int, tile: int,
             radix_bits: int, candidates: int, programs: int, num_warps: int
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    return _topk_rows(x2d, k, largest, sorted, lengths, method, rows_per_program, tile,
                      radix_bits, candidates, programs, num_warps)


@_topk_op.register_fake
def _topk_fake(x2d, k, largest, sorted, lengths, method, rows_per_program, tile, radix_bits,
               candidates, programs, num_warps):
    n_rows = x2d.shape[0]
    return (x2d.new_empty((n_rows, k)), x2d.new_empty((n_rows, k), dtype=torch.int64))


def _topk_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.n_cols = inputs[0].shape[1]


def _topk_backward(ctx, grad_values, _grad_indices):
    (indices,) = ctx.saved_tensors
    n_cols = ctx.n_cols
    # Empty slots (index -1) scatter into a spare column: every real index occurs once per
    # row, so the scatter has no write conflicts and is deterministic.
    target = torch.where(indices >= 0, indices, n_cols)
    grad = grad_values.new_zeros((indices.shape[0], n_cols + 1))
    grad.scatter_(1, target, torch.where(indices >= 0, grad_values, 0))
    return (grad[:, :n_cols],) + (None,) * 11


torch.library.register_autograd("glm_kernels::topk", _topk_backward,
                                setup_context=_topk_setup_context)


def _check_topk_inputs(x, k, dim, lengths):
    _checks.check_tensor("x", x, dtypes=SUPPORTED_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim, got a 0-d tensor")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r}: expected an int in [{-x.dim()}, {x.dim() - 1}] for x "
                         f"of shape {tuple(x.shape)}")
    n = x.shape[dim]
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 0 or k > n:
        raise ValueError(f"k={k} must be in [0, {n}] (the size of dim {dim} of x, shape "
                         f"{tuple(x.shape)}); k larger than a row is an error, not a "
                         "truncation")
    if n > MAX_ROW:
        raise ValueError(f"dim {dim} of x has {n} entries; rows of at most {MAX_ROW} are "
                         "supported (32-bit in-row offsets)")
    if lengths is not None:
        _checks.check_tensor("lengths", lengths, dtypes=(torch.int32, torch.int64))
        batch_shape = x.shape[:dim % x.dim()] + x.shape[dim % x.dim() + 1:]
        rows = batch_shape.numel()
        if lengths.shape != batch_shape and tuple(lengths.shape) != (rows,):
            raise ValueError(f"lengths must have the shape of x without dim {dim}, "
                             f"{tuple(batch_shape)}, or [{rows}]; got shape "
                             f"{tuple(lengths.shape)}")
        _checks.check_same_device(dict(x=x, lengths=lengths))


def topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True,
         *, lengths: Optional[torch.Tensor] = None,
         config: Optional[TopkConfig] = None) -> TopK:
    """Deterministic top-k along ``dim``: the first k of a stable sort, bitwise reproducible.

    Parameters
    ----------
    x : Tensor [..., n, ...], float32 / bfloat16 / float16 / float64 / int32 / int64
        Any shape with at least one dim; any strides (a non-contiguous ``dim`` is copied).
    k : int, 0 <= k <= n
        How many entries to keep. ``k > n`` raises ValueError.
    dim : int, default -1
    largest : bool, default True
        True: largest first (NaN first). False: smallest first (NaN last).
    sorted : bool, default True
        True: in sort order. False: the same set in ascending index order.
    lengths : Tensor, int32 / int64, optional
        Shape of ``x`` without ``dim`` (or [rows]): row i uses only its first lengths[i]
        entries (values are clamped to [0, n]; DSA causal indexer). Slots beyond a row's
        length get index -1 and the value -inf (largest) / +inf (smallest) for floats, the
        dtype's min / max for integers; with ``sorted=False`` they come last.
    config : TopkConfig, optional
        Overrides the launch heuristic ``make_topk_config``.

    Returns
    -------
    TopK(values, indices): values have ``x``'s dtype, indices are int64; both have ``x``'s
    shape with ``dim`` of size k.

    Notes
    -----
    Exactly ``torch.sort(x, dim, descending=largest, stable=True)`` cut to k: equal values
    (-0.0 and +0.0 included) go to the smaller index; every NaN is larger than every number.
    Values are the selected input elements' own bits. Differentiable in ``x`` (float dtypes):
    the gradient of a value flows to the entry it came from.

    Example
    -------
    >>> import torch
    >>> from glm_kernels.topk import topk
    >>> x = torch.tensor([[1.0, 3.0, 3.0, float("nan"), -0.0, 0.0]])
    >>> v, i = topk(x, 4)
    >>> v.tolist(), i.tolist()
    ([[nan, 3.0, 3.0, 1.0]], [[3, 1, 2, 0]])
    >>> topk(x, 2, largest=False, sorted=False).indices.tolist()    # -0.0 ties +0.0
    [[4, 5]]
    >>> topk(x, 3, lengths=torch.tensor([2])).indices.tolist()      # row keeps 2 entries
    [[1, 0, -1]]
    """
    _check_topk_inputs(x, k, dim, lengths)
    largest = _checks.check_bool("largest", largest)
    sorted = _checks.check_bool("sorted", sorted)
    rows_view = x.movedim(dim, -1)
    batch_shape, n_cols = rows_view.shape[:-1], rows_view.shape[-1]
    if rows_view.stride(-1) != 1:
        rows_view = rows_view.contiguous()
    x2d = rows_view.reshape(batch_shape.numel(), n_cols)
    if x2d.shape[0] and x2d.stride(0) < n_cols:      # rows overlap (e.g. expanded): copy
        x2d = x2d.contiguous()
    lengths1d = None if lengths is None else lengths.reshape(-1).contiguous()
    if config is None:
        config = make_topk_config(n_cols, k, x2d.shape[0], x.dtype,
                                  interpret=_dispatch.interpreter_active(), device=x.device)
    _check_config(config, x.dtype)
    args = (x2d, k, largest, sorted, lengths1d, config.method, config.rows_per_program,
            config.tile, config.radix_bits, config.candidates, config.programs,
            config.num_warps)
    needs_graph = torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled())
    # Eager calls without autograd skip the dispatcher (tens of microseconds per call).
    values, indices = _topk_op(*args) if needs_graph else _topk_rows(*args)
    values = values.reshape(batch_shape + (k,)).movedim(-1, dim)
    indices = indices.reshape(batch_shape + (k,)).movedim(-1, dim)
    return TopK(values, indices)
