"""slime delta weight sync, trainer side: one sync's encode (diff + compress + checksum).

Three ways to produce the same files (xor encoding, zstd level 1, one digest per changed
tensor) for a bf16 model whose elements take one-ulp steps at 1% density:

* ``slime-style``: what slime's ``--update-weight-mode delta`` does (written here from its
  documented algorithm): copy every tensor to the host, ``new ^ old`` and ``count_nonzero`` in
  numpy, zstd, digest, in a thread pool;
* ``glm_kernels device``: ``integrations.slime_delta.encode_sync`` with device snapshots (the
  diff runs where the tensor lives; only changed elements are copied out);
* ``glm_kernels host``: the same with a device budget of 0 (full copy, C++ host diff).

The digest is zlib.adler32 for every row (slime's xxh3-128 needs the xxhash package).
Floor: read the new model and its snapshot once on the device (2 x model bytes / measured copy
bandwidth); the host digest of each changed tensor adds host-memory time on top of that.

    python benchmarks/bench_slime_delta.py [--quick]
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from bench_sync import DENSITY, make_state, sparse_step  # noqa: E402

from glm_kernels import _dispatch  # noqa: E402
from glm_kernels.integrations.slime import delta as slime_delta  # noqa: E402

THREADS = min(8, os.cpu_count() or 1)


def digest(buf) -> str:
    return f"{zlib.adler32(memoryview(np.ascontiguousarray(buf))):08x}"


def host_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy().copy()


def slime_style_encode(snapshot, state, pool):
    """Full copy out, numpy xor diff, zstd, digest (slime's trainer-side algorithm)."""
    import zstandard

    def one(name, new):
        diff = new ^ snapshot[name]
        if not np.count_nonzero(diff):
            return name, new, None
        return name, new, (zstandard.ZstdCompressor(level=1).compress(diff), digest(new))
    futures = [pool.submit(one, name, host_bytes(t)) for name, t in state.items()]
    out = {}
    for f in futures:
        name, new, result = f.result()
        snapshot[name] = new
        if result is not None:
            out[name] = result
    return out


def _seconds(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def run(quick: bool = False) -> dict:
    device = _common.default_device()
    total = (8 << 20) if quick else ((512 << 20) if device == "cuda" else (64 << 20))
    reps = 3 if quick else 5
    state = make_state(total, device)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    bandwidth = _common.copy_bandwidth(device)
    baseline = {name: host_bytes(t) for name, t in state.items()}
    slime_snap = {k: v.copy() for k, v in baseline.items()}
    paths = {"glm_kernels device": slime_delta.DeviceSnapshotDiff(
                 {k: v.copy() for k, v in baseline.items()}, device_bytes=2 * model_bytes),
             "glm_kernels host": slime_delta.DeviceSnapshotDiff(
                 {k: v.copy() for k, v in baseline.items()}, device_bytes=0)}
    times = {name: [] for name in ["slime-style", *paths]}
    stage = {name: [] for name in paths}
    wire, copied = {}, {}
    with ThreadPoolExecutor(THREADS) as pool:
        for r in range(reps + 1):                    # the first round warms up
            sparse_step(state, 500 + r)
            s, out = _seconds(lambda: slime_style_encode(slime_snap, state, pool), device)
            if r:
                times["slime-style"].append(s)
            wire["slime-style"] = sum(len(blob) for blob, _ in out.values())
            copied["slime-style"] = model_bytes
            for name, diff_state in paths.items():
                s, out = _seconds(lambda: slime_delta.encode_sync(
                    diff_state, state.items(), "xor", digest, THREADS), device)
                if r:
                    times[name].append(s)
                    stage[name].append(diff_state.stage_seconds)
                wire[name] = sum(blob.nbytes for blob in out[0].values())
                copied[name] = diff_state.copied_out_bytes
    floor = 2 * model_bytes / bandwidth
    base = statistics.median(times["slime-style"])
    rows = []
    for name, ts in times.items():
        t = statistics.median(ts)
        rows.append({"path": name, "time_s": t, "time/floor": t / floor,
                     "slime-style/this": base / t,
                     # in-order part: the device diff + changes copied out, or the full copy
                     "stage_s": statistics.median(stage[name]) if name in stage else None,
                     "copied_off_device_MiB": copied[name] / 2 ** 20,
                     "wire_MiB": wire[name] / 2 ** 20})
    _common.print_table(
        f"slime delta sync encode on {device}: bf16 model {model_bytes / 2 ** 20:.0f} MiB, "
        f"{DENSITY:.0%} one-ulp steps, xor + zstd-1 + adler32, {THREADS} threads (floor "
        f"{floor * 1e3:.2f} ms = 2 x model bytes / {bandwidth / 1e9:.1f} GB/s measured)", rows,
        ["path", "time_s", "time/floor", "slime-style/this", "stage_s", "copied_off_device_MiB",
         "wire_MiB"])
    same_wire = len({round(v) for v in wire.values()}) == 1
    print(f"same compressed bytes on every path: {same_wire}; fallbacks: "
          f"{_dispatch.fallbacks_logged()}")
    return {"device": device, "model_bytes": model_bytes, "density": DENSITY,
            "floor_s": floor, "copy_bandwidth_Bps": bandwidth, "rows": rows,
            "same_wire_bytes": same_wire, "fallbacks": _dispatch.fallbacks_logged(),
            "environment": _common.environment()}


if __name__ == "__main__":
    args = _common.bench_args(__doc__)
    _common.write_json(args.json, run(quick=args.quick))
