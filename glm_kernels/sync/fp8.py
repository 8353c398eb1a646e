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

    def quantize(self, name: str, t: torch.Tensor, spec):
        """{name: (fp8 shard, slice), name + "_scale_inv": (scales, slice)} of one shard."""
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
        q, s = quantize_fp8_blocks(t, self.block)
        sfull = tuple(-(-n // bb) for n, bb in zip(full, self.block))
        sspec = (dim, start // b, -(-stop // b), sfull)
        return {name: (q, (dim, start, stop, full)),
                name + SCALE_SUFFIX: (s, layout.check_slice(f"{name}{SCALE_SUFFIX}", sspec,
                                                            s.shape))}
