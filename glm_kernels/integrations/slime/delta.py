"""slime's delta weight sync with the diff on the GPU: only the changed bytes leave the device.

slime (THUDM/slime, ``--update-weight-mode delta --update-weight-transport disk``) publishes
each weight sync as a directory of zstd-compressed byte diffs that every rollout host applies
into its local checkpoint (``/pull_weights``) before the engines reload it. Its trainer side,
``UpdateWeightFromDiskDelta._encode_delta``, copies *every* gathered HF tensor to host memory
and diffs it there against a host snapshot with numpy. This module replaces that one method:

* Each tensor is diffed where it lives, against an on-device snapshot, by
  ``glm_kernels.delta.encode`` (Triton on CUDA: one read of new and snapshot, the changed
  elements compacted in a second pass). Only the changed elements (int32 position + value)
  cross PCIe: at 1% changed elements of a bf16 model that is ~3% of the bytes slime copies.
* The host snapshot (slime's own ``_snapshot``, uint8 per tensor) is patched at the changed
  bytes only. The kernel hashes the whole new tensor in its read pass; glm_kernels' checksum
  is a sum of per-element terms, so the snapshot's checksum advanced by the changes alone
  (O(changes) on the host) must equal it: a missed or wrong change fails loudly here instead
  of on every rollout host. slime's own digest (``--update-weight-delta-checksum``) of the
  patched snapshot goes into the files as before.
* The files are the ones slime writes (``xor``: zstd(new ^ old); ``overwrite``: zstd(u32 count,
  u32 byte positions, new bytes); zstd level 1, per-tensor checksums in the safetensors
  metadata): the engine side, slime's SGLang ``/pull_weights`` patch, is unchanged.

Tensors whose snapshot does not fit the device budget are copied out whole (through a reused
pinned bounce buffer) and diffed on the host the way slime does it (numpy xor, in the thread
pool): memory-bound, and as fast as slime's own path (benchmarks/notes/slime_delta.md).

If anything fails during a sync (a checksum mismatch, a tensor without a baseline, a size
change, device OOM) every host snapshot patched so far is restored, the device snapshots are
dropped (they are re-uploaded from the host snapshot on the next sync) and the error is
raised: the snapshots again equal what the engines hold, so a retry is safe.

Use: add ``--custom-megatron-init-path glm_kernels.integrations.slime_delta.install`` to a
slime run with ``--update-weight-mode delta``. slime calls the init hook on every trainer
rank before it builds the weight updater, and ``install`` swaps the class slime then picks.
``GLM_KERNELS_SLIME_DELTA_DEVICE_BYTES`` sets the device snapshot memory per rank (a byte
count, or ``N%`` of the device's memory). Unset, every tensor is diffed on the host (slime's
algorithm, logged once): the snapshots stay allocated through training steps, so only the
user can say how much a rank can spare.
Signatures follow THUDM/slime at commit 624b824 (2026-08-21).
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from ... import _dispatch, delta, force_backend
from ...delta import checksum_algebra as ref
from ...delta.packet import parse_payload

logger = logging.getLogger(__name__)

__all__ = ["install", "DeviceSnapshotDiff", "ByteChanges", "encode_sync", "device_budget",
           "xor_payload", "overwrite_payload", "read_delta", "ENV_DEVICE_BYTES"]

ENV_DEVICE_BYTES = "GLM_KERNELS_SLIME_DELTA_DEVICE_BYTES"
_UPDATER_MODULE = "slime.backends.megatron_utils.update_weight.update_weight_from_disk_delta"
# int32 positions address 2^31 elements; larger tensors are diffed in slices of this size.
_SLICE_ELEMENTS = 1 << 30
_ZSTD_LEVEL = 1          # what slime writes and documents (not a knob there either)


@dataclass
class ByteChanges:
    """One tensor's change set at byte granularity, over its ``nbytes`` bytes.

    Sparse (device diff): ``positions`` int64 [count] sorted byte offsets, ``new`` / ``old``
    uint8 [count] the bytes there after / before the step. Dense (host diff): ``dense_xor``
    uint8 [nbytes] = new ^ old and ``new_full`` uint8 [nbytes] the new bytes."""
    nbytes: int
    count: int
    positions: Optional[np.ndarray] = None
    new: Optional[np.ndarray] = None
    old: Optional[np.ndarray] = None
    dense_xor: Optional[np.ndarray] = None
    new_full: Optional[np.ndarray] = None


def xor_payload(changes: ByteChanges) -> np.ndarray:
    """slime's ``xor`` delta before compression: ``new ^ old`` over all ``nbytes`` bytes."""
    if changes.dense_xor is not None:
        return changes.dense_xor
    dense = np.zeros(changes.nbytes, dtype=np.uint8)
    dense[changes.positions] = changes.new ^ changes.old
    return dense


def overwrite_payload(changes: ByteChanges) -> np.ndarray:
    """slime's ``overwrite`` delta before compression: little-endian u32 count, u32 byte
    positions, then the new bytes."""
    if changes.nbytes > 1 << 32:
        raise ValueError(f"--update-weight-delta-encoding overwrite addresses bytes with uint32; "
                         f"a tensor of {changes.nbytes} bytes needs xor")
    positions, new = changes.positions, changes.new
    if positions is None:
        positions = np.flatnonzero(changes.dense_xor)
        new = changes.new_full[positions]
    count = np.array([positions.size], dtype="<u4").view(np.uint8)
    return np.concatenate([count, positions.astype("<u4").view(np.uint8), new])


def read_delta(blob, nbytes: int, encoding: str) -> np.ndarray:
    """One tensor's slime delta file decompressed, with the output bounded *before* anything
    is decompressed (zstd decompression bombs, issue 17): the frame must declare its content
    size (every frame written here does) and that size must fit the tensor's ``nbytes``:
    exactly ``nbytes`` for ``xor``, at most ``4 + 5 * nbytes`` for ``overwrite`` (u32 count,
    u32 position and a byte per changed byte). For engine-side readers of these files;
    slime's own ``/pull_weights`` reader is slime's code. Raises ValueError."""
    import zstandard

    if encoding not in ("xor", "overwrite"):
        raise ValueError(f"encoding must be 'xor' or 'overwrite', got {encoding!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise TypeError(f"nbytes must be an int >= 0, got {nbytes!r}")
    data = memoryview(np.ascontiguousarray(blob)).cast("B") if isinstance(blob, np.ndarray) \
        else memoryview(blob)
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise ValueError(f"corrupt slime delta: {exc}") from None
    bound = nbytes if encoding == "xor" else 4 + 5 * nbytes
    if declared < 0 or declared > bound or (encoding == "xor" and declared != nbytes):
        what = "no content size" if declared < 0 else f"{declared} bytes"
        raise ValueError(f"slime {encoding} delta declares {what}; a tensor of {nbytes} bytes "
                         f"allows {'exactly' if encoding == 'xor' else 'at most'} {bound} "
                         f"(refused before decompressing)")
    try:
        # allow_extra_data=False: a trailing frame (or any byte after the frame) is refused
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=bound,
                                                      allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise ValueError(f"corrupt slime delta: {exc}") from None
    if len(out) != declared:
        raise ValueError(f"corrupt slime delta: {len(out)} bytes, the frame declares {declared}")
    return np.frombuffer(out, np.uint8)


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return ref.int_view(t.contiguous())


def _slices(numel: int):
    return [(lo, min(lo + _SLICE_ELEMENTS, numel)) for lo in range(0, max(numel, 1),
                                                                     _SLICE_ELEMENTS)]


def _element_changes(new: torch.Tensor, base: torch.Tensor
                     ) -> Tuple[np.ndarray, np.ndarray, List[int]]:
    """Changed element positions (int64), their new bit patterns (unsigned numpy) and the
    checksum word sum S of each slice of ``new``, hashed by the kernel in its read pass
    (independent of the changes it reports: what makes the caller's check meaningful)."""
    positions, values, sums = [], [], []
    words = ref.words_per_element(new.element_size())
    for lo, hi in _slices(new.numel()):
        packet = delta.encode(new[lo:hi], base[lo:hi], encoding="int32")
        streams = parse_payload(packet)
        positions.append(streams.positions.astype(np.int64) + lo)
        values.append(np.array(streams.values, copy=True))
        sums.append(ref.unfinalize(packet.result_checksum, (hi - lo) * words))
    return np.concatenate(positions), np.concatenate(values), sums


def _advance_sums(sums: List[int], positions: np.ndarray, new_values: np.ndarray,
                  old_values: np.ndarray) -> List[int]:
    """S of each slice after replacing ``old_values`` by ``new_values`` at ``positions``:
    the checksum is a sum of per-element terms, so only the changed terms move."""
    out = []
    for i, (lo, hi) in enumerate(_slices(_SLICE_ELEMENTS * len(sums))):
        at = (positions >= lo) & (positions < hi)
        local = positions[at] - lo
        moved = int(ref.element_terms(new_values[at], local).sum(dtype=np.uint64)) - \
            int(ref.element_terms(old_values[at], local).sum(dtype=np.uint64))
        out.append((sums[i] + moved) & ref.MASK64)
    return out


def _to_bytes(positions: np.ndarray, values: np.ndarray, old_values: np.ndarray,
              size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Element changes (new and old bit patterns at ``positions``) -> the changed bytes only
    (an element whose low byte moved by one ulp keeps its other bytes out of the delta, as
    slime's byte diff does)."""
    new_bytes = values.view(np.uint8).reshape(-1, size)
    old_bytes = old_values.view(np.uint8).reshape(-1, size)
    byte_pos = positions[:, None] * size + np.arange(size, dtype=np.int64)
    moved = new_bytes != old_bytes
    return byte_pos[moved], new_bytes[moved], old_bytes[moved]


def _host_sums(snapshot: np.ndarray, dtype: torch.dtype) -> List[int]:
    """S of each slice of a host snapshot (once per tensor; later syncs advance it)."""
    flat = torch.from_numpy(snapshot).view(dtype)
    words = ref.words_per_element(flat.element_size())
    with force_backend("torch"):        # host bytes: the C++ codec, whatever the caller forced
        return [ref.unfinalize(delta.checksum(flat[lo:hi]), (hi - lo) * words)
                for lo, hi in _slices(flat.numel())]


def device_budget(setting: Optional[str], device: torch.device) -> int:
    """Bytes of device snapshots allowed from ``GLM_KERNELS_SLIME_DELTA_DEVICE_BYTES``: a
    byte count, or ``N%`` of the device's total memory (CUDA). Unset: 0, every tensor is
    diffed on the host as slime does. There is no automatic default on purpose: the snapshots
    stay allocated through the training steps, whose activation peak the free memory seen at
    sync time does not show; only the user knows the headroom."""
    if setting is None or not setting.strip():
        _dispatch.warn_once("slime_delta.budget", f"glm_kernels slime delta: {ENV_DEVICE_BYTES} "
                            f"unset, every tensor is diffed on the host (slime's algorithm); set "
                            f"it to the device memory a rank can spare, e.g. 8000000000 or 10%")
        return 0
    text = setting.strip()
    bad = ValueError(f"{ENV_DEVICE_BYTES} must be a byte count or a percentage of the device's "
                     f"memory like 10%, got {setting!r}")
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise bad from None
        if not 0.0 <= percent <= 100.0:
            raise bad
        if device.type != "cuda":
            raise ValueError(f"{ENV_DEVICE_BYTES}={setting!r}: a percentage needs CUDA tensors "
                             f"(got {device.type}); give a byte count")
        return int(torch.cuda.mem_get_info(device)[1] * percent / 100.0)
    if not text.isdigit():
        raise bad
    return int(text)


class DeviceSnapshotDiff:
    """The snapshot bookkeeping and diff of one trainer rank, independent of slime.

    ``host`` is slime's snapshot dict (name -> uint8 numpy array of the bytes the engines
    hold). Device copies are made on first use, up to ``device_bytes`` in total (None: from
    the environment, see :func:`device_budget`); a tensor
    beyond the budget is copied out whole and diffed on the host as slime does (numpy xor:
    memory-bound, the best a host can do). ``stage(name, tensor)`` does the part that must
    run in order (the device diff, or the copy out) and returns ``(nbytes, work)``, where
    ``work()`` (thread-safe across tensors) finishes the tensor's :class:`ByteChanges` and
    advances its host snapshot. ``rollback()`` undoes everything since ``commit()``.
    """

    _STAGING_BYTES = 256 << 20          # pinned bounce buffer for full copies (reused)

    def __init__(self, host: Dict[str, np.ndarray], device_bytes: Optional[int] = None):
        self.host = host
        self.device: Dict[str, torch.Tensor] = {}
        self.device_bytes = device_bytes
        self.used_bytes = 0
        self.copied_out_bytes = 0           # device -> host bytes of the last sync
        self.stage_seconds = 0.0            # last sync: in order (device diff / copy out)
        self.sums: Dict[str, List[int]] = {}    # glm_kernels checksum word sums of ``host``
        self._undo: list = []               # ("patch", name, pos, old) | ("swap", name, array)
        self._staging = None                # pinned bounce buffer; False: unavailable

    def _budget(self, device: torch.device) -> int:
        if self.device_bytes is None:
            self.device_bytes = device_budget(os.environ.get(ENV_DEVICE_BYTES), device)
        return self.device_bytes

    def _host_snapshot(self, name: str, nbytes: int) -> np.ndarray:
        if name not in self.host:
            raise KeyError(f"tensor {name!r} has no baseline snapshot (slime seeds one per "
                           f"tensor from --hf-checkpoint at the first sync)")
        snap = self.host[name]
        if snap.nbytes != nbytes:
            raise ValueError(f"tensor {name!r} has {nbytes} bytes but its snapshot has "
                             f"{snap.nbytes}: a delta needs the same layout every sync")
        return snap

    def stage(self, name: str, tensor: torch.Tensor) -> Tuple[int, Callable[[], ByteChanges]]:
        new = _int_view(tensor.detach())
        nbytes = new.numel() * new.element_size()
        self._host_snapshot(name, nbytes)
        if name not in self.device and self.used_bytes + nbytes <= self._budget(new.device):
            if not self.host[name].flags.writeable:     # slime's baseline: the file's bytes
                self.host[name] = self.host[name].copy()
            upload = torch.from_numpy(self.host[name]).view(new.dtype)
            self.device[name] = torch.empty_like(new).copy_(upload)
            self.used_bytes += nbytes
        if name in self.device:
            changes = self._device_diff(name, new)
            return nbytes, lambda: changes
        new_full = self._copy_out(new.view(torch.uint8))
        self.copied_out_bytes += nbytes
        return nbytes, lambda: self._host_diff(name, new_full)

    def diff(self, name: str, tensor: torch.Tensor) -> ByteChanges:
        """``stage`` and its work in one call."""
        return self.stage(name, tensor)[1]()

    def _copy_out(self, flat: torch.Tensor) -> np.ndarray:
        """A fresh host copy of the uint8 view ``flat`` (it becomes the next snapshot)."""
        if flat.device.type != "cuda":
            return flat.numpy().copy()           # .cpu() would alias a CPU tensor
        if self._staging is None:
            try:
                self._staging = torch.empty(self._STAGING_BYTES, dtype=torch.uint8,
                                            pin_memory=True)
            except RuntimeError as exc:     # e.g. a low memlock limit: pageable copies
                _dispatch.warn_once("slime_delta.pinned", f"glm_kernels slime delta: no pinned "
                                    f"bounce buffer ({exc}); copying through pageable memory")
                self._staging = False
        if self._staging is False:
            return flat.cpu().numpy()            # already a fresh host array
        out = np.empty(flat.numel(), dtype=np.uint8)
        for lo in range(0, flat.numel(), self._STAGING_BYTES):
            piece = flat[lo:lo + self._STAGING_BYTES]
            bounce = self._staging[:piece.numel()]
            bounce.copy_(piece, non_blocking=True)
            torch.cuda.current_stream(flat.device).synchronize()
            np.copyto(out[lo:lo + piece.numel()], bounce.numpy())
        return out

    def _host_diff(self, name: str, new_full: np.ndarray) -> ByteChanges:
        old = self.host[name]
        dense_xor = np.bitwise_xor(new_full, old)
        count = int(np.count_nonzero(dense_xor))
        self._undo.append(("swap", name, old))      # list.append is atomic across threads
        self.host[name] = new_full                  # becomes the next sync's base
        return ByteChanges(new_full.nbytes, count, dense_xor=dense_xor, new_full=new_full)

    def _device_diff(self, name: str, new: torch.Tensor) -> ByteChanges:
        size, nbytes = new.element_size(), new.numel() * new.element_size()
        snap = self.host[name]                  # made writable when uploaded
        if name not in self.sums:
            self.sums[name] = _host_sums(snap, new.dtype)
        positions, values, new_sums = _element_changes(new, self.device[name])
        self.copied_out_bytes += positions.size * (4 + size)
        old_values = snap.view(ref.NP_UINT[size])[positions]
        byte_pos, new_bytes, old_bytes = _to_bytes(positions, values, old_values, size)
        self._undo.append(("patch", name, byte_pos, old_bytes))
        snap[byte_pos] = new_bytes
        self.device[name].copy_(new)
        # The kernel hashed the whole new tensor; the snapshot's sum moved by the changes'
        # terms only: they agree iff no change was missed or misreported.
        advanced = _advance_sums(self.sums[name], positions, values, old_values)
        self.sums[name] = new_sums
        if advanced != new_sums:
            raise RuntimeError(f"delta of {name!r}: the patched host snapshot does not match "
                               f"the new tensor (diff kernel wrong or memory corrupted); "
                               f"nothing of this sync is published")
        return ByteChanges(nbytes, int(byte_pos.size), byte_pos, new_bytes, old_bytes)

    def commit(self) -> None:
        self._undo.clear()

    def rollback(self) -> None:
        """Restore the host snapshots changed since ``commit`` and drop the device copies
        (re-uploaded from the host snapshots when next used)."""
        for entry in reversed(self._undo):
            if entry[0] == "patch":
                _, name, byte_pos, old_bytes = entry
                self.host[name][byte_pos] = old_bytes
            else:
                _, name, old = entry
                self.host[name] = old
        self._undo.clear()
        self.device.clear()
        self.sums.clear()
        self.used_bytes = 0


def encode_sync(state: DeviceSnapshotDiff, tensors: Iterable[Tuple[str, torch.Tensor]],
                encoding: str, digest: Callable[[np.ndarray], str], threads: int
                ) -> Tuple[Dict[str, np.ndarray], Dict[str, str], int, int]:
    """One sync: ``(compressed deltas, checksums, changed bytes, total bytes)`` for every
    tensor that changed, in slime's format. A pool of ``threads`` finishes, compresses and
    digests each tensor while the next one is diffed / copied out. All or nothing on errors."""
    import zstandard

    if encoding not in ("xor", "overwrite"):
        raise ValueError(f"--update-weight-delta-encoding must be 'xor' or 'overwrite', got "
                         f"{encoding!r}")
    build = xor_payload if encoding == "xor" else overwrite_payload

    def finish(name: str, work: Callable[[], ByteChanges]):
        changes = work()
        if changes.count == 0:
            return name, None, None, 0
        blob = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(build(changes))
        return name, np.frombuffer(blob, dtype=np.uint8), digest(state.host[name]), changes.count

    compressed: Dict[str, np.ndarray] = {}
    checksums: Dict[str, str] = {}
    changed = total = 0
    state.copied_out_bytes, state.stage_seconds = 0, 0.0
    inflight: deque = deque()
    workers = max(1, threads)
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        def collect(future):
            nonlocal changed
            name, blob, digest_hex, count = future.result()
            if count:
                compressed[name], checksums[name] = blob, digest_hex
                changed += count
        for name, tensor in tensors:
            started = time.perf_counter()
            nbytes, work = state.stage(name, tensor)
            state.stage_seconds += time.perf_counter() - started
            total += nbytes
            inflight.append(pool.submit(finish, name, work))
            if len(inflight) >= 2 * workers:    # bounds the host copies held in flight
                collect(inflight.popleft())
        while inflight:
            collect(inflight.popleft())
    except BaseException:
        for future in inflight:
            future.cancel()
        pool.shutdown(wait=True)            # running workers finish before the undo
        state.rollback()
        raise
    pool.shutdown(wait=True)
    state.commit()
    return compressed, checksums, changed, total


class _DeviceDiffEncode:
    """Mixin placed before slime's ``UpdateWeightFromDiskDelta``: only ``_encode_delta``
    changes; it fills the same attributes slime's version fills."""

    def _encode_delta(self) -> None:
        from slime.utils.disk_delta import NUM_WORKERS, checksum

        self._version_dir = os.path.join(self.delta_dir, f"weight_v{self.weight_version:06d}")
        if self._is_pp_src_rank:
            os.makedirs(self._version_dir, exist_ok=True)
        state = getattr(self, "_glm_kernels_diff", None)
        if state is None or state.host is not self._snapshot:
            state = self._glm_kernels_diff = DeviceSnapshotDiff(self._snapshot)
        algorithm = self.checksum_algorithm
        self._delta, self._checksums, self.changed_bytes, self.total_bytes = encode_sync(
            state, self._iter_hf_tensors(), self.delta_encoding,
            lambda buf: checksum(algorithm, buf), NUM_WORKERS)
        self.copied_out_bytes = state.copied_out_bytes
        if self.total_bytes:
            logger.info("[glm_kernels delta v=%s] %d of %d bytes changed, %d bytes copied off "
                        "the device (%.2f%%)", self.weight_version, self.changed_bytes,
                        self.total_bytes, state.copied_out_bytes,
                        100.0 * state.copied_out_bytes / self.total_bytes)


def install(args=None):
    """slime ``--custom-megatron-init-path`` hook: make slime's delta weight sync diff on the
    device. Called as ``install(args)`` on every trainer rank before the weight updater is
    built; also callable by hand (``args=None``) before slime creates its actors' updaters.
    Idempotent. Returns the class slime will instantiate."""
    if args is not None and getattr(args, "update_weight_mode", "delta") != "delta":
        raise ValueError(f"glm_kernels.integrations.slime_delta.install replaces slime's delta "
                         f"weight sync; run with --update-weight-mode delta "
                         f"--update-weight-transport disk (got --update-weight-mode "
                         f"{args.update_weight_mode!r})")
    import importlib
    module = importlib.import_module(_UPDATER_MODULE)
    base = module.UpdateWeightFromDiskDelta
    if issubclass(base, _DeviceDiffEncode):
        return base
    patched = type("DeviceDiffUpdateWeightFromDiskDelta", (_DeviceDiffEncode, base),
                   {"__doc__": base.__doc__, "__module__": __name__})
    module.UpdateWeightFromDiskDelta = patched
    return patched
