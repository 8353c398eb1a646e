"""Delta weight codec: send only the elements whose bit pattern changed (docs/design.md 3.5).

Backends (docs/design.md 2): CUDA tensors run the Triton kernels (``_kernels`` via
``_device``); the ``interpret`` backend runs the same kernels on CPU tensors; ``torch`` (the
CPU default) runs the host codec: the C++ extension ``glm_kernels._host``, or numpy when it
is not built (logged once). Every backend produces the same streams and checksums, bit for bit.

Not a ``torch.library`` custom op: a packet is a Python object whose size depends on the
data, so there is nothing for ``torch.compile`` to trace; call it outside compiled regions.
"""
from __future__ import annotations

import mmap
import os
import traceback
from typing import Optional

import numpy as np
import torch

from .. import _checks, _dispatch, _safetensors
from . import _device, _host_codec
from . import _reference as ref
from ._device import DeltaKernelConfig, default_config
from .packet import (ENCODINGS, SUPPORTED_DTYPES, DeltaPacket, build_payload, check_packet,
                     check_threads, check_zstd_level, parse_payload, require_zstd, stream_spec)


def _check_pair(new, old):
    _checks.check_tensor("new", new, dtypes=SUPPORTED_DTYPES)
    _checks.check_tensor("old", old)
    _checks.check_same_shape("old", old, "new", new)
    if old.dtype != new.dtype:
        raise TypeError(f"old must have dtype {new.dtype} like new, got {old.dtype}")
    _checks.check_same_device(dict(new=new, old=old))


def _n_words(numel: int, dtype: torch.dtype) -> int:
    return numel * ref.words_per_element(torch.empty(0, dtype=dtype).element_size())


def encode(new: torch.Tensor, old: torch.Tensor, *, encoding: str = "gap16",
           zstd_level: int = 3, relative: bool = True, old_checksum: Optional[bytes] = None,
           threads: int = -1, config: Optional[DeltaKernelConfig] = None) -> DeltaPacket:
    """Packet that turns ``old`` into ``new`` bit for bit.

    Parameters
    ----------
    new, old : Tensor, same shape, dtype and device; any 1/2/4/8-byte dtype of
        ``packet.SUPPORTED_DTYPES`` (fp32, bf16, fp16, fp8, int8..int64, fp64, bool).
        A changed element is one whose bit pattern differs (-0.0 vs +0.0 and different NaN
        payloads are changes). Non-contiguous inputs are copied.
    encoding : {"gap16", "int32", "zstd"}, default "gap16"
        int32: absolute int32 positions (refuses tensors past 2^31 elements) + raw values.
        gap16: uint16 gaps between positions (escape 65535 + a uint64 list for gaps that do
        not fit, free when unused) + raw values.
        zstd: gap16 gaps and values as byte planes, one zstd frame per plane (needs the
        ``zstandard`` package), frames compressed in parallel on the host.
    zstd_level : int, default 3
    relative : bool, default True
        zstd only: code values as zigzag(new - old) of the bit patterns (an optimizer step of
        one unit in the last place costs ~1 bit); the packet then carries the base checksum
        and applies only onto that exact base.
    old_checksum : bytes (8), optional
        ``checksum(old)`` when the caller knows it -- the previous packet's
        ``result_checksum`` in a chain of updates. Then neither tensor is hashed (the result
        checksum is derived from it and the changed elements only), which makes encode
        several times cheaper on the host and removes the checksum from the GPU's read pass.
        A wrong value makes every receiver refuse the packet; it cannot corrupt a target.
    threads : int, default -1 (every core)
        Host threads (C++ codec, zstd frames).
    config : DeltaKernelConfig, optional
        Kernel tile sizes (Triton path); default ``default_config(device)``.

    Returns
    -------
    DeltaPacket
        ``count`` changed elements, checksums of the result (and base), the payload: host
        bytes, or a uint8 tensor on the GPU for int32/gap16 from CUDA tensors.

    Notes
    -----
    On the Triton path, a transient int16 scratch of ``numel`` elements (2 bytes per element)
    holds the compacted change offsets between the two passes.

    Example
    -------
    >>> import torch
    >>> from glm_kernels.delta import encode, apply_, DeltaPacket
    >>> old = torch.randn(1000).bfloat16()
    >>> new = old.clone(); new.view(torch.int16)[::100] += 1      # ten one-ulp steps
    >>> packet = encode(new, old, encoding="gap16")
    >>> packet.count, packet.nbytes()
    (10, 116)
    >>> target = old.clone()
    >>> _ = apply_(target, DeltaPacket.from_bytes(packet.to_bytes()))
    >>> torch.equal(target.view(torch.int16), new.view(torch.int16))
    True
    """
    _checks.check_choice("encoding", encoding, ENCODINGS)
    check_zstd_level(zstd_level)
    check_threads(threads)
    _check_pair(new, old)
    if encoding == "zstd":
        require_zstd()
    if encoding == "int32":
        ref.check_int32_addressable(new.numel())
    relative = _checks.check_bool("relative", relative) and encoding == "zstd"
    spec = stream_spec(encoding, relative)
    size, n = new.element_size(), new.numel()
    words = _n_words(n, new.dtype)
    old_sum = None
    if old_checksum is not None:
        if not isinstance(old_checksum, (bytes, bytearray)) or len(old_checksum) != 8:
            raise TypeError(f"old_checksum must be 8 bytes (a checksum()), got "
                            f"{type(old_checksum).__name__} {old_checksum!r:.40}")
        old_sum = ref.unfinalize(bytes(old_checksum), words)
    backend = _dispatch.select_backend("delta.encode", new, old)
    if backend == "torch":
        nb = ref.np_bits(new.detach().cpu().contiguous())
        ob = ref.np_bits(old.detach().cpu().contiguous())
        streams = _host_codec.encode_streams(nb, ob, spec, threads, old_sum)
        payload = build_payload(streams, encoding, size, zstd_level, threads)
        count, n_esc, s_new, s_old = (streams.count, streams.escapes.size, streams.s_new,
                                      streams.s_old)
    else:
        cfg = config or default_config(new.device, size)
        dev = _device.encode(ref.int_view(new.detach().contiguous()),
                             ref.int_view(old.detach().contiguous()), spec, encoding, cfg,
                             old_sum)
        count, n_esc, s_new, s_old = dev.count, dev.n_escapes, dev.s_new, dev.s_old
        if encoding == "zstd":
            planes = dev.planes.cpu().numpy()
            streams = ref.Streams(count, planes[:2 * count],
                                  dev.escapes.cpu().numpy().view(np.uint64), planes[2 * count:])
            payload = build_payload(streams, encoding, size, zstd_level, threads)
        else:
            payload = dev.payload
    return DeltaPacket(new.dtype, n, encoding, count, n_esc, ref.finalize(s_new, words),
                       ref.finalize(s_old, words) if relative else b"", payload)


def _check_target(target, packet):
    _checks.check_tensor("target", target)
    check_packet(packet)          # in-memory packets too: nothing unchecked reaches a kernel
    if target.dtype != packet.dtype:
        raise TypeError(f"target has dtype {target.dtype}, the packet is for {packet.dtype}")
    if target.numel() != packet.numel:
        raise ValueError(f"target has {target.numel()} elements (shape "
                         f"{tuple(target.shape)}), the packet is for {packet.numel}")
    if not target.is_contiguous():
        raise ValueError(f"target must be contiguous (applied in place), got strides "
                         f"{target.stride()}")


def apply_(target: torch.Tensor, packet: DeltaPacket, *, threads: int = -1,
           config: Optional[DeltaKernelConfig] = None) -> torch.Tensor:
    """Apply ``packet`` to ``target`` in place; afterwards ``target`` is bit-identical to the
    ``new`` the packet was encoded from. No floating-point arithmetic on values.

    Everything is verified before the first write: dtype, numel, contiguity, the payload
    structure (positions in range and strictly increasing, escapes consistent), the base
    checksum of base-relative packets, and the checksum of the result -- computed from the
    target's checksum sum plus the changed elements' terms, so no copy of the target is made.
    Any failure raises ValueError/TypeError and leaves ``target`` bit-identical to before.
    Scratch memory: O(count) (decoded positions), never O(numel). :func:`verify` runs the
    same checks without the write.

    Parameters
    ----------
    target : Tensor, contiguous, the packet's dtype and numel (any shape), CPU or CUDA.
    packet : DeltaPacket (e.g. ``DeltaPacket.from_bytes(wire)``).
    threads : int, default -1 (every core); host path only.
    config : DeltaKernelConfig, optional (Triton path).

    Returns
    -------
    target

    Example
    -------
    >>> import torch
    >>> from glm_kernels.delta import encode, apply_
    >>> old = torch.zeros(5); new = torch.tensor([0.0, -0.0, 0.0, float("nan"), 2.0])
    >>> target = old.clone()
    >>> apply_(target, encode(new, old, encoding="int32"))
    tensor([0., -0., 0., nan, 2.])
    """
    _verify_then_write(target, packet, threads, config, write=True)
    if packet.count and hasattr(torch.autograd.graph, "increment_version"):
        torch.autograd.graph.increment_version(target)   # written behind autograd's back
    return target


def verify(target: torch.Tensor, packet: DeltaPacket, *, threads: int = -1,
           config: Optional[DeltaKernelConfig] = None) -> None:
    """Run every check :func:`apply_` makes, without writing: returns None if
    ``apply_(target, packet)`` would succeed, otherwise raises the error it would raise.

    The checks are apply_'s own (one shared code path on every backend): dtype, numel,
    contiguity, payload structure, base checksum, result checksum. ``target`` is only read
    (one pass, for its checksum); scratch memory is O(count), never O(numel). On the host
    backend a CUDA target is copied to the host first, as in :func:`apply_`. A caller that
    must apply several packets all-or-nothing verifies them all first, then applies them
    (``glm_kernels.sync.Receiver`` does); ``apply_`` checks again before its first write.

    Parameters
    ----------
    target : Tensor, contiguous, the packet's dtype and numel (any shape), CPU or CUDA.
    packet : DeltaPacket.
    threads : int, default -1 (every core); host path only.
    config : DeltaKernelConfig, optional (Triton path).

    Example
    -------
    >>> import torch
    >>> from glm_kernels.delta import encode, verify
    >>> old = torch.zeros(5); new = torch.tensor([0.0, 1.0, 0.0, 0.0, 2.0])
    >>> packet = encode(new, old)
    >>> verify(old, packet)                       # would apply: returns None
    >>> try:
    ...     verify(torch.ones(5), packet)         # not the packet's base
    ... except ValueError as exc:
    ...     print(str(exc)[:31])
    delta result checksum mismatch:
    """
    _verify_then_write(target, packet, threads, config, write=False)


def _verify_then_write(target, packet, threads, config, write: bool) -> None:
    """The one verification path of apply_ (write=True: then scatter) and verify."""
    check_threads(threads)
    _check_target(target, packet)
    if packet.encoding == "zstd":
        require_zstd()
    spec = stream_spec(packet.encoding, packet.relative)
    backend = _dispatch.select_backend("delta.apply_" if write else "delta.verify", target)
    with torch.no_grad():
        if backend == "torch":
            host = target if target.device.type == "cpu" else target.cpu()
            _host_codec.apply_streams(ref.np_bits(host), parse_payload(packet, threads), spec,
                                      packet.result_checksum, packet.base_checksum, threads,
                                      write=write)
            if write and host is not target:
                target.copy_(host)
        else:
            host_streams = parse_payload(packet, threads) if packet.encoding == "zstd" else None
            _device.apply(ref.int_view(target), packet, spec, host_streams,
                          config or default_config(target.device, target.element_size()),
                          write=write)


def checksum(t: torch.Tensor, *, threads: int = -1,
             config: Optional[DeltaKernelConfig] = None) -> bytes:
    """8-byte checksum of a tensor's bit patterns, as carried by packets.

    ``checksum(new) == encode(new, old).result_checksum`` on every backend; a receiver can
    compare its weights with the sender's without moving them.

    >>> import torch
    >>> from glm_kernels.delta import checksum, encode
    >>> a = torch.arange(6, dtype=torch.float32)
    >>> checksum(a) == encode(a, torch.zeros(6)).result_checksum
    True
    """
    _checks.check_tensor("t", t, dtypes=SUPPORTED_DTYPES)
    check_threads(threads)
    words = _n_words(t.numel(), t.dtype)
    if _dispatch.select_backend("delta.checksum", t) == "torch":
        s = _host_codec.checksum_sum(ref.np_bits(t.detach().cpu().contiguous()), threads)
    else:
        s = _device.checksum_sum(ref.int_view(t.detach().contiguous()),
                                 config or default_config(t.device, t.element_size()))
    return ref.finalize(s, words)


def apply_safetensors_(path: str, name: str, packet: DeltaPacket, *, threads: int = -1) -> None:
    """Apply ``packet`` in place to tensor ``name`` of a safetensors file, memory-mapped.

    Same checks and guarantee as :func:`apply_` (nothing is written unless every check
    passes); only the changed elements' pages are written. The file must be a regular file
    (no symlink followed, a FIFO never waited on) and its whole header valid -- every tensor
    inside the data section, none overlapping another (``_safetensors.read_header``) --
    before the packet is even decoded: a forged header cannot aim the write at the header
    or past the file. Runs the host codec (C++, multithreaded). Not atomic against a crash
    in the middle of the scatter: a publisher that needs that writes a new file and renames
    it.
    """
    check_packet(packet)
    check_threads(threads)
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    fd, file_size = _safetensors.open_regular(os.fspath(path), writable=True)
    with os.fdopen(fd, "r+b") as f:
        _, infos = _safetensors.read_header(f.fileno(), file_size)
        info = infos.get(name)
        if info is None:
            raise KeyError(f"{path}: no tensor named {name!r}")
        dtype, size = info.dtype, torch.empty(0, dtype=info.dtype).element_size()
        numel = info.nbytes // size
        if dtype != packet.dtype:
            raise TypeError(f"{path}:{name} has dtype {info.st_dtype}, the packet is for "
                            f"{packet.dtype}")
        if numel != packet.numel:
            raise ValueError(f"{path}:{name} has {numel} elements, the packet is for "
                             f"{packet.numel}")
        if packet.encoding == "zstd":
            require_zstd()
        streams = parse_payload(packet, threads)
        spec = stream_spec(packet.encoding, packet.relative)
        if numel == 0:
            _host_codec.apply_streams(np.zeros(0, ref.NP_UINT[size]), streams, spec,
                                      packet.result_checksum, packet.base_checksum, threads)
            return
        mapped = mmap.mmap(f.fileno(), 0)
        bits = None
        try:
            bits = np.frombuffer(mapped, dtype=ref.NP_UINT[size], count=numel,
                                 offset=info.begin)
            _host_codec.apply_streams(bits, streams, spec, packet.result_checksum,
                                      packet.base_checksum, threads)
            mapped.flush()
        except BaseException as exc:
            # The map cannot close while a view of it is alive, and the traceback's frames
            # hold ``bits`` as a local: drop those locals (the traceback keeps its lines).
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            bits = None
            mapped.close()
