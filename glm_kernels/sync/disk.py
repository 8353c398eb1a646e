"""Disk transport: each version as safetensors files in a directory, published atomically.

Directory layout::

    MANIFEST.json                         {"format": 1, "latest": v, "versions": [
                                             {"v": 10, "base": null, "files": [...]},
                                             {"v": 11, "base": 10, "files": [...]}, ...]}
    v00000010-full-0000.safetensors       a full snapshot: tensors in their own dtype/shape
    v00000011-delta-0000.safetensors      a delta: uint8 tensors holding delta packets
                                          (new names in a delta version are stored full)
    FULL_REQUESTED                        present while a receiver asks for a full snapshot

Every file is at most about ``bucket_bytes`` of tensor data (one tensor never spans files) and
carries ``__metadata__["glm_sync"]`` = JSON ``{"v", "base", "entries": {name: {"k", "dt",
"sh", "ck"}}}``. Files are written under a temporary name, flushed to disk and renamed; the
manifest is rewritten the same way *after* all files of a version exist, so a reader that
follows the manifest never sees a half-written version. Full snapshot files are ordinary
safetensors checkpoints (``safetensors.torch.load_file`` reads them).

Retention: a full snapshot at least every ``full_every`` versions (the sender asks the
transport before each publish); versions older than the ``keep_full``-th newest full snapshot
are removed from the manifest and then deleted. A reader that loses a race with that deletion
re-reads the manifest.
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, Iterable, List, Optional

import torch

from .protocol import DTYPES, Entry, SyncError, Transport, Update, byte_view, dtype_name

MANIFEST = "MANIFEST.json"
REQUEST = "FULL_REQUESTED"
_ST_DTYPE = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
             "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
             "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
assert set(_ST_DTYPE) == set(DTYPES)
_COPY_CHUNK = 64 << 20


def _fsync_replace(tmp: str, final: str) -> None:
    """Rename ``tmp`` over ``final`` once its bytes are on disk (and the rename too)."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    try:
        fd = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
    except OSError:   # platforms without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]):
    """Write a safetensors file streaming each tensor's bytes (any device, shared storage
    allowed): ``safetensors.torch.save_file`` refuses tensors that share storage (tied or
    flat-buffer parameters) and would need a host copy of the whole shard."""
    header, offset = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPE[dtype_name(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            data = byte_view(t.contiguous())
            for start in range(0, data.numel(), _COPY_CHUNK):
                f.write(memoryview(data[start:start + _COPY_CHUNK].cpu().numpy()))


class DiskTransport(Transport):
    """Versions as files in ``path`` (shared storage between trainer and rollout hosts works).

    Parameters
    ----------
    path : str
        Directory (created if missing). The sender's first version must be newer than the
        directory's latest (``latest_version()``; start the Sender with that version).
    full_every : int, default 10
        A full snapshot at least every this many versions (bounds a late reader's chain).
    keep_full : int, default 2
        Full snapshots (and the deltas after them) kept on disk.
    poll_interval : float, default 0.05
        Seconds between manifest reads while a receiver waits.

    Example::

        link = sync.DiskTransport("/shared/weights")
        sync.Sender(link, delta=True).publish(model.state_dict())          # trainer
        sync.Receiver(link, rollout_model.state_dict()).receive(timeout=60) # rollout
    """

    def __init__(self, path: str, *, full_every: int = 10, keep_full: int = 2,
                 poll_interval: float = 0.05):
        if full_every < 1 or keep_full < 1:
            raise ValueError(f"full_every and keep_full must be >= 1, got {full_every}, "
                             f"{keep_full}")
        self.path = os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        self.full_every = int(full_every)
        self.keep_full = int(keep_full)
        self.poll_interval = float(poll_interval)
        self._delivered: Optional[int] = None   # version last handed to the receiver
        self._refused: set = set()

    # ------------------------------------------------------------------ manifest
    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_manifest(self) -> dict:
        try:
            with open(self._file(MANIFEST)) as f:
                manifest = json.load(f)
        except FileNotFoundError:
            return {"format": 1, "latest": 0, "versions": []}
        except (OSError, ValueError) as exc:
            raise SyncError(f"unreadable manifest {self._file(MANIFEST)}: {exc}") from exc
        if manifest.get("format") != 1 or not isinstance(manifest.get("versions"), list):
            raise SyncError(f"manifest {self._file(MANIFEST)} has an unknown layout")
        return manifest

    def latest_version(self) -> int:
        return int(self.read_manifest()["latest"])

    # ------------------------------------------------------------------ sender side
    def full_requested(self) -> bool:
        try:
            os.remove(self._file(REQUEST))
            return True
        except FileNotFoundError:
            pass
        since_full = 0
        for record in reversed(self.read_manifest()["versions"]):
            if record["base"] is None:
                return since_full + 1 >= self.full_every
            since_full += 1
        return True   # nothing full on disk yet

    def send(self, version: int, base: Optional[int], entries: Iterable[Entry],
             bucket_bytes: int) -> None:
        manifest = self.read_manifest()
        if version <= manifest["latest"]:
            raise ValueError(f"version {version} is not newer than v{manifest['latest']} "
                             f"already in {self.path}; start the Sender with "
                             f"version=DiskTransport.latest_version()")
        kind = "full" if base is None else "delta"
        files: List[str] = []
        shard: Dict[str, torch.Tensor] = {}
        described: Dict[str, dict] = {}
        size = 0

        def flush():
            name = f"v{version:08d}-{kind}-{len(files):04d}.safetensors"
            tmp = self._file(f".tmp-{os.getpid()}-{name}")
            meta = {"glm_sync": json.dumps({"v": version, "base": base, "entries": described})}
            try:
                write_safetensors(tmp, shard, meta)
                _fsync_replace(tmp, self._file(name))
            except BaseException:
                if os.path.exists(tmp):
                    os.remove(tmp)
                raise
            files.append(name)

        for e in entries:
            n = e.payload.numel()
            if shard and size + n > bucket_bytes:
                flush()
                shard, described, size = {}, {}, 0
            shard[e.name] = e.payload.view(e.dtype).reshape(e.shape) if e.kind == "full" \
                else e.payload
            described[e.name] = {"k": e.kind, "dt": dtype_name(e.dtype), "sh": list(e.shape),
                                 "ck": e.checksum.hex()}
            size += n
        if shard or not files:
            flush()
        self._publish_manifest(manifest, {"v": version, "base": base, "files": files})

    def _publish_manifest(self, manifest: dict, record: dict) -> None:
        versions = manifest["versions"] + [record]
        fulls = [i for i, r in enumerate(versions) if r["base"] is None]
        keep_from = fulls[-self.keep_full] if len(fulls) >= self.keep_full else 0
        dropped, versions = versions[:keep_from], versions[keep_from:]
        tmp = self._file(f".tmp-{os.getpid()}-{MANIFEST}")
        with open(tmp, "w") as f:
            json.dump({"format": 1, "latest": record["v"], "versions": versions}, f)
        _fsync_replace(tmp, self._file(MANIFEST))
        for r in dropped:   # after the manifest stops naming them
            for name in r["files"]:
                try:
                    os.remove(self._file(name))
                except FileNotFoundError:
                    pass

    # ------------------------------------------------------------------ receiver side
    def _next_record(self, held: int) -> Optional[dict]:
        versions = [r for r in self.read_manifest()["versions"] if r["v"] not in self._refused]
        for r in versions:
            if r["base"] is not None and r["base"] == held:
                return r   # the delta on top of what the receiver holds
        fulls = [r for r in versions if r["base"] is None and r["v"] > held]
        return fulls[-1] if fulls else None

    def recv(self, held: int, timeout: Optional[float]) -> Optional[Update]:
        deadline = None if timeout is None else time.monotonic() + timeout
        attempts, self._delivered = 0, None
        while True:
            record = self._next_record(held)
            if record is not None:
                self._delivered = record["v"]
                try:
                    return self._load(record)
                except FileNotFoundError:   # deleted by retention after we read the manifest
                    attempts += 1
                    if attempts >= 5:
                        raise SyncError(f"files of v{record['v']} keep disappearing") from None
                    continue
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_interval if deadline is None
                       else max(0.0, min(self.poll_interval, deadline - time.monotonic())))

    def _load(self, record: dict) -> Update:
        from safetensors import safe_open
        version, base = record["v"], record["base"]
        entries = []
        for name in record["files"]:
            path = self._file(name)
            if not os.path.exists(path):
                raise FileNotFoundError(path)
            try:
                with safe_open(path, framework="pt") as f:
                    meta = json.loads((f.metadata() or {})["glm_sync"])
                    if meta["v"] != version or meta["base"] != base:
                        raise SyncError(f"{name} holds v{meta['v']} (base {meta['base']}), "
                                        f"the manifest says v{version} (base {base})")
                    for tname, d in meta["entries"].items():
                        t = f.get_tensor(tname)
                        entries.append(Entry(tname, d["k"], DTYPES[d["dt"]], tuple(d["sh"]),
                                             bytes.fromhex(d["ck"]), byte_view(t.contiguous())))
            except SyncError:
                raise
            except Exception as exc:   # safetensors/JSON/KeyError: a damaged file ...
                if not os.path.exists(path):   # ... or one deleted while we opened it
                    raise FileNotFoundError(path) from exc
                raise SyncError(f"v{version}: unreadable file {name}: {exc}") from exc
        return Update(version, base, entries)

    def report(self, version: int, ok: bool) -> None:
        if ok:
            return
        if self._delivered is not None:
            self._refused.add(self._delivered)
        with open(self._file(REQUEST), "w") as f:
            f.write(str(version))
