"""FP8 rollout weights: bf16 master weights published as float8_e4m3fn with block scales.

``FP8Blocks(block=(128, 128), names=...)`` given to a sharded ``Sender(fp8=...)`` publishes each
selected 2-D weight ``<name>`` as its FP8 bytes and ``<name>_scale_inv`` (fp32, one per block,
``amax / 448``: DeepSeek-V3's checkpoint names, which SGLang's FP8 block loader reads). The
sender keeps the quantized bytes and scales as its base and sends their deltas; a receiver
holding FP8 tensors gets exactly ``quantize_fp8_blocks(new master weight)``.
"""
from typing import Callable, Optional, Sequence, Union

import torch

from .. import _checks, _dispatch
from . import _reference as ref
from . import layout

SCALE_SUFFIX = "_scale_inv"
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_fp8_blocks(w: torch.Tensor, block=(128, 128)):
    """(q float8_e4m3fn [R, C], scale_inv float32 [ceil(R/br), ceil(C/bc)]) of a 2-D weight.

    Math in ``_reference`` (per block: amax = max|w| floored at 1e-4, q = fp8(w * 448 / amax),
    scale_inv = amax / 448, all fp32). CUDA tensors run the Triton kernel (``interpret``
    backend: the same kernel on CPU); the CPU default is the reference. Bitwise equal on every
    backend.
    """
    _checks.check_tensor("w", w, dtypes=_INPUT_DTYPES)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [rows, cols], got shape {tuple(w.shape)}")
    block = _check_block(block)
    w = w.detach().contiguous()
    if _dispatch.select_backend("sync.quantize_fp8_blocks", w) == "torch":
        return ref.quantize_fp8_blocks(w, block)
    from . import _kernels
    return _kernels.quantize_fp8_blocks(w, block)


def _check_block(block):
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
            or any(b & (b - 1) for b in block)):
        raise ValueError(f"block must be two powers of two (rows, cols), got {block!r:.40}")
    return tuple(block)


class FP8Blocks:
    """Which weights a sharded Sender publishes in FP8, and with which blocks.

    Parameters
    ----------
    block : (int, int), default (128, 128)
        Rows and columns of a scale block (powers of two).
    names : callable(name) -> bool, or a list of names; default: every 2-D weight whose name
        ends with ``"weight"`` (pass a callable to leave out embeddings, norms, the router).

    A trainer shard of a selected weight must be cut on block boundaries (its rows
    ``[start, stop)`` multiples of the block, ``stop`` may be the last row), so each rank
    computes whole blocks; its ``_scale_inv`` is published with the matching rows.
    """

    def __init__(self, block=(128, 128), names: Optional[Union[Callable[[str], bool],
                                                               Sequence[str]]] = None):
        self.block = _check_block(block)
        if names is None:
            self._select = lambda n: n.endswith("weight")
        elif callable(names):
            self._select = names
        elif isinstance(names, (list, tuple, set, frozenset)) and all(isinstance(n, str)
                                                                      for n in names):
            chosen = frozenset(names)
            self._select = chosen.__contains__
        else:
            raise TypeError(f"names must be a callable or a list of str, got "
                            f"{type(names).__name__}")

    def __repr__(self):
        return f"FP8Blocks(block={self.block})"

    def selects(self, name: str) -> bool:
        return bool(self._select(name))

    def quantize(self, name: str, t: torch.Tensor, spec, band_bytes: int = 1 << 26):
        """{name: (fp8 shard, slice), name + "_scale_inv": (scales, slice)} of one shard.

        The FP8 shard is a :class:`LazyFP8`: its bytes are quantized band by band when a
        piece (or the base) is read, so a publish never holds the shard's FP8 copy; the
        scales (1/16384 of the elements) are computed here, in bands of about
        ``band_bytes`` FP8 bytes."""
        if t.dim() != 2 or t.dtype not in _INPUT_DTYPES:
            raise TypeError(f"fp8 weight {name!r} must be a 2-D {_INPUT_DTYPES} tensor, got "
                            f"{t.dtype} of shape {tuple(t.shape)}")
        full = tuple(spec[3]) if spec is not None else tuple(t.shape)
        dim, start, stop = (spec[0], spec[1], spec[2]) if spec is not None else (0, 0, full[0])
        b = self.block[dim]
        if start % b or (stop % b and stop != full[dim]):
            raise ValueError(f"fp8 weight {name!r}: the shard [{start}, {stop}) of dim {dim} is "
                             f"not on {b}-element block boundaries; shard FP8 weights on "
                             f"multiples of the block")
        q = LazyFP8(t, self.block)
        s = q.scales(band_bytes)
        sfull = tuple(-(-n // bb) for n, bb in zip(full, self.block))
        sspec = (dim, start // b, -(-stop // b), sfull)
        return {name: (q, (dim, start, stop, full)),
                name + SCALE_SUFFIX: (s, layout.check_slice(f"{name}{SCALE_SUFFIX}", sspec,
                                                            s.shape))}


class LazyFP8:
    """The float8_e4m3fn bytes of one 2-D shard, computed on indexing.

    ``lazy[rows, cols]`` (slices with step 1) quantizes the whole blocks around the box and
    returns the box: every block is quantized on its own (its amax, its scale), so a box cut
    from a band equals the same box of ``quantize_fp8_blocks(shard)`` bit for bit, and
    memory holds one band, not the shard's FP8 copy. The shard's block boundaries are the
    full weight's (``FP8Blocks.quantize`` checks the shard is cut on them). On the CPU the
    torch reference's fp32 temporaries (about 16 bytes per element) are bounded to one block
    row at a time; the CUDA kernel writes the FP8 bytes with no temporaries, a band at once.
    """

    dtype = torch.float8_e4m3fn

    def __init__(self, weight: torch.Tensor, block):
        self.weight, self.block = weight, tuple(block)
        self.shape, self.device = weight.shape, weight.device

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.weight.numel()

    def element_size(self) -> int:
        return 1

    def _row_steps(self, start: int, stop: int, band_rows: int):
        """Row ranges of whole blocks covering [start, stop): one block row each on the CPU,
        bands of ``band_rows`` (a block multiple) on CUDA."""
        step = band_rows if self.device.type == "cuda" else self.block[0]
        return [(r, min(stop, r + step)) for r in range(start, stop, step)]

    def __getitem__(self, index) -> torch.Tensor:
        if not (isinstance(index, tuple) and len(index) == 2
                and all(isinstance(i, slice) and i.step in (None, 1) for i in index)):
            raise TypeError(f"LazyFP8 takes two unit-step slices, got {index!r:.80}")
        (a0, a1), (b0, b1) = [i.indices(n)[:2] for i, n in zip(index, self.shape)]
        (r0, r1), (c0, c1) = [(a // b * b, min(n, -(-c // b) * b)) for (a, c), b, n in
                              zip(((a0, a1), (b0, b1)), self.block, self.shape)]
        out = torch.empty(max(a1 - a0, 0), max(b1 - b0, 0), dtype=self.dtype,
                          device=self.device)
        for lo, hi in self._row_steps(r0, r1, r1 - r0):
            q, _ = quantize_fp8_blocks(self.weight[lo:hi, c0:c1], self.block)
            keep0, keep1 = max(lo, a0), min(hi, a1)
            out[keep0 - a0:keep1 - a0] = q[keep0 - lo:keep1 - lo, b0 - c0:b1 - c0]
        return out

    def scales(self, band_bytes: int) -> torch.Tensor:
        """fp32 [ceil(R/br), ceil(C/bc)] scale_inv of the shard, in bands of whole blocks of
        about ``band_bytes`` FP8 bytes on CUDA (one block row at a time on the CPU)."""
        rows, cols = self.shape
        band_rows = max(1, band_bytes // max(cols * self.block[0], 1)) * self.block[0]
        bands = [quantize_fp8_blocks(self.weight[lo:hi], self.block)[1]
                 for lo, hi in self._row_steps(0, rows, band_rows)]
        return torch.cat(bands) if bands else torch.empty(
            0, -(-cols // self.block[1]), dtype=torch.float32, device=self.device)
