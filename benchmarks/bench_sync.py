"""Weight sync end to end: publish -> applied on the receiver, per transport, full vs delta.

A bf16 "model" (12 tensors of odd sizes) takes one-ulp steps at 1% density (what an
optimizer step at a small learning rate does to bf16 weights). Each transport is timed from
``Sender.publish`` to the receiver having applied the update (an acknowledgement for the
process-based ones), for a full snapshot and for a delta (zstd), next to the plain way to do
the same without glm_kernels (peer): the state dict on a multiprocessing queue (IPC),
safetensors save_file/load_file (disk), one ``dist.broadcast`` per tensor (gloo).

Floors, from the copy bandwidth measured in the same run: full = read + write the model once;
delta = read the new and the previous model once (finding the changes cannot do less).

    python benchmarks/bench_sync.py [--quick]
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from glm_kernels import _dispatch, sync  # noqa: E402

N_TENSORS = 12
DENSITY = 0.01


def make_state(total_bytes: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per = total_bytes // 2 // N_TENSORS
    return {f"layer.{i}.w": (torch.randn(per + 2 * i + 1, generator=g) * 0.02)
            .bfloat16().to(device) for i in range(N_TENSORS)}


def sparse_step(state, seed: int):
    """One-ulp moves of DENSITY of the elements (bf16 bit patterns +-1)."""
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        bits = t.view(torch.int16)
        mask = (torch.rand(t.numel(), generator=g) < DENSITY).to(t.device)
        bits += mask.to(torch.int16)


def _nbytes(state):
    return sum(t.numel() * t.element_size() for t in state.values())


def _median_s(fn, state, reps, *, step_first):
    times = []
    for r in range(reps):
        if step_first:
            sparse_step(state, 1000 + r + len(times) * 7)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(sender, publish_full, publish_delta, peer, state, reps):
    """Seconds for full, delta and peer (each returns once the receiver has applied) and the
    payload bytes of the last delta and full updates."""
    publish_full()                                   # first version, warms everything up
    out = {"delta_s": _median_s(publish_delta, state, reps, step_first=True),
           "delta_payload_bytes": sender.last_stats.payload_bytes}
    out["full_s"] = _median_s(publish_full, state, reps, step_first=False)
    out["full_payload_bytes"] = sender.last_stats.payload_bytes
    if peer is not None:
        out["peer_s"] = _median_s(peer, state, reps, step_first=True)
    return out


# --------------------------------------------------------------------------- in-process
def bench_local(state, reps):
    link = sync.LocalTransport()
    sender = sync.Sender(link, delta=True)
    receiver = sync.Receiver(link, {k: torch.empty_like(v) for k, v in state.items()})
    return _measure(sender, *_in_process(sender, receiver, state), None, state, reps)


def _in_process(sender, receiver, state):
    """(full, delta) publish-then-apply callables for a receiver in this process."""
    def full():
        sender.publish(state, full=True)
        receiver.poll()

    def delta():
        sender.publish(state)
        receiver.poll()
    return full, delta


def bench_disk(state, reps):
    from safetensors.torch import load_file, save_file
    with tempfile.TemporaryDirectory() as root:
        sender = sync.Sender(sync.DiskTransport(os.path.join(root, "sync"), full_every=10 ** 6),
                             delta=True)
        params = {k: torch.empty_like(v) for k, v in state.items()}
        receiver = sync.Receiver(sync.DiskTransport(os.path.join(root, "sync")), params)

        def peer():
            path = os.path.join(root, "peer.safetensors")
            save_file({k: v.cpu() for k, v in state.items()}, path + ".tmp")
            os.replace(path + ".tmp", path)
            for k, v in load_file(path).items():
                params[k].copy_(v)
        return _measure(sender, *_in_process(sender, receiver, state), peer, state, reps)


# --------------------------------------------------------------------------- IPC
def _ipc_child(link, peer_q, ack_q, shapes, device):
    torch.set_num_threads(1)
    params = {k: torch.empty(n, dtype=torch.bfloat16, device=device) for k, n in shapes.items()}
    receiver = sync.Receiver(link, params)
    while True:
        kind = ack_q.get()
        if kind == "stop":
            return
        if kind == "sync":
            ack_q.put(receiver.receive(timeout=300))
        else:
            for k, v in peer_q.get().items():
                params[k].copy_(v)
            ack_q.put("peer")


def bench_ipc(state, reps):
    ctx = mp.get_context("spawn")
    link = sync.IpcTransport(ctx)
    peer_q, ack_q = ctx.Queue(), _TwoWay(ctx)
    device = str(next(iter(state.values())).device)
    proc = ctx.Process(target=_ipc_child, daemon=True,
                       args=(link, peer_q, ack_q, {k: v.numel() for k, v in state.items()},
                             device))
    proc.start()
    sender = sync.Sender(link, delta=True)
    try:
        def synced(full):
            def fn():
                ack_q.ask("sync")
                sender.publish(state, full=full)
                ack_q.answer()
            return fn

        def peer():
            ack_q.ask("peer")
            peer_q.put({k: v.clone() for k, v in state.items()})
            ack_q.answer()
        return _measure(sender, synced(True), synced(False), peer, state, reps)
    finally:
        ack_q.ask("stop")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


class _TwoWay:
    """Command queue to the child and answer queue back (picklable pair)."""

    def __init__(self, ctx):
        self.to_child, self.to_parent = ctx.SimpleQueue(), ctx.SimpleQueue()

    def ask(self, what):
        self.to_child.put(what)

    def answer(self):
        return self.to_parent.get()

    # child side
    def get(self):
        return self.to_child.get()

    def put(self, what):
        self.to_parent.put(what)


# --------------------------------------------------------------------------- gloo
def _gloo_rank(rank, init_file, total_bytes, reps, result_q):
    import datetime
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    link = sync.BroadcastTransport(src=0)
    state = make_state(total_bytes)
    if rank == 0:
        sender = sync.Sender(link, delta=True)

        def peer():
            for v in state.values():
                dist.broadcast(v, 0)
            dist.barrier()
        result_q.put(_measure(sender, lambda: sender.publish(state, full=True),
                              lambda: sender.publish(state), peer, state, reps))
    else:
        params = {k: torch.empty_like(v) for k, v in state.items()}
        receiver = sync.Receiver(link, params)
        for _ in range(1 + 2 * reps):
            receiver.receive()
        for _ in range(reps):
            for v in params.values():
                dist.broadcast(v, 0)
            dist.barrier()
    dist.destroy_process_group()


def bench_gloo(total_bytes, reps):
    ctx = mp.get_context("spawn")
    result_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as root:
        procs = [ctx.Process(target=_gloo_rank, daemon=True,
                             args=(r, os.path.join(root, "pg"), total_bytes, reps, result_q))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            res = result_q.get(timeout=600)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    return res


# --------------------------------------------------------------------------- receiver apply
def _apply_via_scratch_clones(params, update):
    """The v1 receiver's method, kept here as the baseline: every delta applied to a scratch
    clone of its tensor (all-or-nothing across tensors), then every tensor copied in. Same
    checks as the receiver: payload digest, packet parse, apply_'s verification."""
    from glm_kernels.delta import DeltaPacket, apply_
    staged = []
    for e in update.entries:
        param = params[e.name]
        if sync.protocol.digest(e.payload) != e.checksum:
            raise sync.SyncError(f"{e.name}: payload checksum mismatch")
        packet = DeltaPacket.from_bytes(e.payload.cpu().numpy().tobytes())
        scratch = param.detach().clone()
        apply_(scratch, packet)
        staged.append((param, scratch))
    for param, scratch in staged:
        param.copy_(scratch)


def bench_receiver_apply(state, reps):
    """Receiver side only: ``Receiver.apply_update`` of a delta update (verify all, then
    apply in place) vs the scratch-clone method, on the same update, same base, one run."""
    link = sync.LocalTransport()
    sender = sync.Sender(link, delta=True)
    receiver = sync.Receiver(link, {k: torch.empty_like(v) for k, v in state.items()})
    sender.publish(state)
    receiver.poll()
    baseline = {k: v.clone() for k, v in receiver.params.items()}
    inplace, clones = [], []
    for r in range(reps):
        sparse_step(state, 2000 + r)
        sender.publish(state)
        update = sync.protocol.assemble(link.updates.popleft())
        for times, fn in ((clones, lambda: _apply_via_scratch_clones(baseline, update)),
                          (inplace, lambda: receiver.apply_update(update))):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    for name, t in state.items():
        if not (torch.equal(receiver.params[name], t) and torch.equal(baseline[name], t)):
            raise AssertionError(f"receiver apply benchmark: {name} differs from the sender")
    extra = sum(t.numel() * t.element_size() for t in state.values())
    return {"inplace_s": statistics.median(inplace), "scratch_clone_s": statistics.median(clones),
            "scratch_clone_extra_bytes": extra,
            "changed": sender.last_stats.changed}


# --------------------------------------------------------------------------- driver
def run(quick: bool = False) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # GPU: 256 MiB, not GLM-5 sized: the codec's host path (~0.1 GB/s here) and the host
    # checksums bound every figure, and gpu_check has 8 minutes for everything.
    total = (8 << 20) if quick else ((256 << 20) if device == "cuda" else (64 << 20))
    reps = 3 if quick or device == "cuda" else 5
    bandwidth = _common.copy_bandwidth(device)
    state = make_state(total, device)
    model_bytes = _nbytes(state)
    rows, notes = [], {}
    benches = {"local": lambda: bench_local(state, reps), "disk": lambda: bench_disk(state, reps),
               "ipc": lambda: bench_ipc(state, reps)}
    for name, fn in benches.items():
        try:
            res = fn()
        except Exception as exc:   # reported, not hidden
            notes[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        rows.append({"transport": name, **res})
    try:
        rows.append({"transport": "gloo(2 proc, cpu)", **bench_gloo(min(total, 64 << 20), reps)})
    except Exception as exc:
        notes["gloo"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    try:
        receiver_apply = bench_receiver_apply(state, reps)
        receiver_apply["clone/inplace"] = (receiver_apply["scratch_clone_s"]
                                           / receiver_apply["inplace_s"])
        _common.print_table(
            f"receiver apply of one delta update ({model_bytes / 2 ** 20:.0f} MiB model, "
            f"{DENSITY:.0%} changed): verify all then apply in place vs the v1 method "
            "(scratch clone per delta tensor, then copy)", [receiver_apply],
            ["inplace_s", "scratch_clone_s", "clone/inplace", "scratch_clone_extra_bytes",
             "changed"])
    except Exception as exc:   # reported, not hidden
        receiver_apply = None
        notes["receiver_apply"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    for r in rows:
        mb = model_bytes if not r["transport"].startswith("gloo") else _nbytes(
            make_state(min(total, 64 << 20)))
        r["model_MiB"] = mb / 2 ** 20
        r["floor_s"] = 2 * mb / bandwidth      # same byte count for both, see module doc
        r["full/floor"] = r["full_s"] / r["floor_s"]
        r["delta/floor"] = r["delta_s"] / r["floor_s"]
        r["delta_bytes/full_bytes"] = r["delta_payload_bytes"] / r["full_payload_bytes"]
        if "peer_s" in r:
            r["peer/delta"] = r["peer_s"] / r["delta_s"]
        r["full_GBps"] = mb / r["full_s"] / 1e9
    columns = ["transport", "model_MiB", "floor_s", "full_s", "full/floor", "full_GBps", "delta_s",
               "delta/floor", "peer_s", "peer/delta", "delta_bytes/full_bytes"]
    _common.print_table(f"weight sync publish->applied on {device}, bf16, {DENSITY:.0%} one-ulp "
                        f"steps, zstd deltas (copy bandwidth {bandwidth / 1e9:.1f} GB/s "
                        "measured; floor = 2 x model bytes / bandwidth)", rows, columns)
    if notes:
        print("notes:", notes)
    print("fallbacks logged:", _dispatch.fallbacks_logged())
    return {"benchmark": "sync", "device": device, "density": DENSITY,
            "copy_bandwidth_Bps": bandwidth, "rows": rows, "receiver_apply": receiver_apply,
            "notes": notes,
            "fallbacks": _dispatch.fallbacks_logged(), "environment": _common.environment()}


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
