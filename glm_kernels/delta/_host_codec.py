"""Host (CPU) path of the delta codec: the C++ extension ``glm_kernels._host`` when it is
built (multithreaded), otherwise the numpy definition in ``_reference`` -- a fallback that
is logged once, never silent. Both produce identical streams and checksums."""
from __future__ import annotations

import os

import numpy as np

from .. import _dispatch
from . import _reference as ref

import importlib.util

if importlib.util.find_spec("glm_kernels._host") is None:
    # Not built (no compiler at install time): "cannot import name" would suggest a
    # circular import, so say what is missing instead.
    _ext = None
    _EXT_ERROR = "the C++ host codec was not built"
else:
    try:
        from .. import _host as _ext
        _EXT_ERROR = ""
    except ImportError as exc:      # built for another Python / a broken build
        _ext = None
        _EXT_ERROR = f"the C++ host codec does not load: {type(exc).__name__}: {exc}"


def resolve_threads(threads) -> int:
    """threads < 1 (or None) means every core."""
    return max(1, os.cpu_count() or 1) if threads is None or threads < 1 else int(threads)


def extension():
    """The C++ module, or None after logging (once per process) that numpy is used instead."""
    if _ext is None:
        _dispatch.warn_once(
            "delta:host_extension",
            f"glm_kernels._host: {_EXT_ERROR}; the delta codec's CPU path uses numpy "
            "instead (20-60x slower). Build it with a C++17 compiler and pybind11: "
            "pip install --no-build-isolation . (or -e . in a checkout)")
    return _ext


def checksum_sum(bits: np.ndarray, threads: int = -1) -> int:
    ext = extension()
    return ext.checksum_sum(bits, resolve_threads(threads)) if ext else ref.checksum_sum(bits)


def encode_streams(nb: np.ndarray, ob: np.ndarray, spec: ref.StreamSpec, threads: int = -1,
                   old_sum: int = None) -> ref.Streams:
    """See ``_reference.encode_streams`` (``old_sum``: S(old) known, nothing hashed)."""
    ext = extension()
    if ext is None:
        return ref.encode_streams(nb, ob, spec, old_sum)
    if spec.positions == "int32":
        ref.check_int32_addressable(nb.size)
    out = ext.encode(nb, ob, spec.positions == "gap16", spec.diff, spec.planar,
                     old_sum is None, resolve_threads(threads))
    if old_sum is None:
        s_new, s_old = out["s_new"], out["s_old"]
    else:
        s_new, s_old = (old_sum + out["s_delta"]) & ref.MASK64, old_sum
    return ref.Streams(out["count"], out["positions"], out["escapes"], out["values"], s_new,
                       s_old)


def apply_streams(bits: np.ndarray, streams: ref.Streams, spec: ref.StreamSpec,
                  result_checksum: bytes, base_checksum: bytes = b"", threads: int = -1,
                  write: bool = True) -> None:
    """Verify, then (``write``) write into the unsigned array ``bits``, which must then be
    writable (see _reference). ``write=False`` runs every check and writes nothing."""
    ext = extension()
    if ext is None:
        if write:
            ref.apply_streams(bits, streams, spec, result_checksum, base_checksum)
        else:
            ref.verify_streams(bits, streams, spec, result_checksum, base_checksum)
        return
    ext.apply(bits, spec.positions == "gap16", spec.diff, spec.planar, streams.positions,
              streams.escapes, streams.values, streams.count, result_checksum, base_checksum,
              resolve_threads(threads), write)
