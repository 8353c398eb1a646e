"""Safetensors files as this package reads and writes them: streamed writes, validated reads.

Layout (the safetensors format)::

    u64 little-endian header length N | N bytes of JSON | data section
    JSON: {"__metadata__": {str: str}, name: {"dtype": "BF16", "shape": [...],
           "data_offsets": [begin, end]}, ...}      offsets are bytes into the data section

Used by ``delta.apply_safetensors_`` (patches one tensor of a file in place) and the disk
transport of ``glm_kernels.sync`` (reads and writes whole files). Nothing a file says is
trusted before it is checked, and nothing is allocated, read or written from a size it
claims until every tensor of the header has passed:

* the path is opened without following a symlink and without blocking (``O_NONBLOCK``: a
  FIFO planted at the name would otherwise block the open, and then every read, forever),
  and must be a regular file (``fstat``);
* the header is at most ``MAX_HEADER_BYTES`` and fits in the file; its JSON is bounded in
  size and nesting before it is parsed (no RecursionError);
* every tensor has a known dtype, a shape of non-negative ints, ``0 <= begin <= end <=``
  the data section, ``end - begin`` equal to its element count times its element size, and
  no two tensors share a byte -- so the tensors together never claim more than the file
  holds (overlapping offsets would make a small file read as many times its size).
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from ._json import json_loads_bounded

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {d: n for n, d in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20          # the safetensors library's own limit
MAX_DIMS = 64
_COPY_CHUNK = 64 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str, *, writable: bool = False, error: type = ValueError):
    """(fd, size) of a regular file, opened read-only (or read-write) without following a
    symlink and without blocking; ``error`` for a link, a FIFO, a directory, a device.
    FileNotFoundError passes through (callers treat a vanished file on their own)."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | _NOFOLLOW | _NONBLOCK | _CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:          # ELOOP: a symlink; EISDIR: a directory opened for writing
        raise error(f"{path}: cannot open as a regular file without following links "
                    f"({exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file (a {file_kind(st.st_mode)}): refused")
        if _NONBLOCK:               # regular files ignore it; cleared so writes stay plain
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def file_kind(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words (for error messages)."""
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special file"


def read_exact(fd: int, n: int, at: int, *, error: type = ValueError) -> torch.Tensor:
    """``n`` bytes of ``fd`` from offset ``at`` into a fresh uint8 tensor (no zero fill).
    Callers bound ``n`` by the file size first."""
    buf = torch.empty(n, dtype=torch.uint8)
    view, got = memoryview(buf.numpy()), 0
    while got < n:
        if hasattr(os, "preadv"):
            chunk = os.preadv(fd, [view[got:got + _COPY_CHUNK]], at + got)
        else:
            data = os.pread(fd, min(n - got, _COPY_CHUNK), at + got)
            view[got:got + len(data)] = data
            chunk = len(data)
        if chunk == 0:
            raise error(f"file shorter than its header says ({got} of {n} bytes at {at})")
        got += chunk
    return buf


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checked header; ``begin``/``end`` are absolute file offsets."""
    dtype: torch.dtype
    st_dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(fd: int, size: int, *, error: type = ValueError
                ) -> Tuple[Dict[str, str], Dict[str, TensorInfo]]:
    """(``__metadata__``, {name: TensorInfo}) of the safetensors file ``fd`` of ``size`` bytes,
    with every check of the module docstring made; one ``error`` otherwise. Reads only the
    header (at most ``min(size, MAX_HEADER_BYTES)`` bytes)."""
    if size < 8:
        raise error(f"{size} bytes: not a safetensors file (shorter than 8 bytes)")
    n = int.from_bytes(read_exact(fd, 8, 0, error=error).numpy().tobytes(), "little")
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise error(f"header of {n} bytes in a file of {size} (at most "
                    f"{min(size - 8, MAX_HEADER_BYTES)} fit)")
    header = json_loads_bounded(read_exact(fd, n, 8, error=error).numpy().tobytes(),
                                "safetensors header", max_bytes=n, max_depth=8, error=error)
    if not isinstance(header, dict):
        raise error(f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise error("__metadata__ is not a mapping of strings to strings")
    data_start, data_size = 8 + n, size - 8 - n
    infos = {}
    for name, info in header.items():
        infos[name] = _check_tensor(name, info, data_start, data_size, error)
    spans = sorted((i.begin, i.end, name) for name, i in infos.items() if i.nbytes)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise error(f"tensors {a!r} and {b!r} overlap in the data section (refused: "
                        f"overlapping offsets make a file read as more than it holds)")
    return metadata, infos


def _check_tensor(name: str, info, data_start: int, data_size: int, error) -> TensorInfo:
    where = f"tensor {name!r:.80}"
    if not isinstance(info, dict):
        raise error(f"{where}: entry is {type(info).__name__}, not an object")
    st_dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = DTYPES.get(st_dtype) if isinstance(st_dtype, str) else None
    if dtype is None:
        raise error(f"{where}: dtype {st_dtype!r:.40} is not one of {list(DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(_is_int(d) and d >= 0 for d in shape)):
        raise error(f"{where}: malformed shape {shape!r:.80}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise error(f"{where}: malformed data_offsets {offsets!r:.80}")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    want = numel * torch.empty(0, dtype=dtype).element_size()
    if not (0 <= begin <= end <= data_size and end - begin == want):
        raise error(f"{where}: data_offsets {offsets} do not hold {st_dtype} {shape} "
                    f"({want} bytes) inside the {data_size}-byte data section")
    return TensorInfo(dtype, st_dtype, tuple(shape), data_start + begin, data_start + end)


def write_to(f, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
    """Write a safetensors file to the binary file object ``f``, streaming each tensor's bytes
    (any device, storage shared between tensors allowed: ``safetensors.torch.save_file``
    refuses tied or flat-buffer parameters and would need a host copy of the whole shard)."""
    header, offset = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for t in tensors.values():
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, data.numel(), _COPY_CHUNK):
            f.write(memoryview(data[start:start + _COPY_CHUNK].cpu().numpy()))


def write(path: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
    """:func:`write_to` a new file at ``path``."""
    with open(path, "wb") as f:
        write_to(f, tensors, metadata)
