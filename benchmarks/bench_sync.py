"""Weight sync end to end: publish -> applied on the receiver, per transport, full vs delta.

A bf16 "model" (12 tensors of odd sizes) takes one-ulp steps at 1% density (what an
optimizer step at a small learning rate does to bf16 weights). Each transport is timed from
``Sender.publish`` to the receiver having applied the update (an acknowledgement for the
process-based ones), for a full snapshot and for a delta (zstd), next to the plain way to do
the same without glm_kernels (peer): the state dict on a multiprocessing queue (IPC),
safetensors save_file/load_file (disk), one ``dist.broadcast`` per tensor (gloo).

Floors, from the copy bandwidth measured in the same run: full = read + write the model once;
delta = read the new and the previous model once (finding the changes cannot do less).

Sharded publishing (``bench_sharded``): four trainer ranks each publishing their Shard(0)
shard to a TP-2 engine over P2PTransport, next to one sender holding the whole model
(BroadcastTransport delta) and a full ``dist.broadcast`` of every tensor, in one gloo world.

    python benchmarks/bench_sync.py [--quick] [--sharded-only]
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
        bits = t.view(-1).view(torch.int16)
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


# --------------------------------------------------------------------------- sharded
SHARD_TRAINERS, SHARD_ENGINES, SHARD_COLS = 4, 2, 512


def _shard_state(total_bytes, step):
    """Full bf16 model (N_TENSORS [rows, 512] weights) after ``step`` one-ulp steps."""
    g = torch.Generator().manual_seed(0)
    rows = max(SHARD_TRAINERS * 2, total_bytes // 2 // N_TENSORS // SHARD_COLS)
    state = {f"layer.{i}.w": (torch.randn(rows + 3 * i, SHARD_COLS, generator=g) * 0.02)
             .bfloat16() for i in range(N_TENSORS)}
    for s in range(1, step + 1):
        sparse_step(state, 5000 + s)
    return state


def _cut(n, parts, i):
    return n * i // parts, n * (i + 1) // parts


def _sharded_rank(rank, world, total_bytes, reps, out_dir):
    """Three ways to the same engines in one gloo world (trainers 0..T-1, engines T..):
    sharded (every trainer its shard, P2P, each engine rank its TP slice), one sender (rank 0
    holds the whole model, BroadcastTransport delta), full broadcast (dist.broadcast of every
    tensor from rank 0). Returns rank 0's timings and every engine's bytes."""
    import datetime
    import json
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    trainers = list(range(SHARD_TRAINERS))
    engines = list(range(SHARD_TRAINERS, world))
    tgroup, egroup = dist.new_group(trainers), dist.new_group(engines)
    one = dist.new_group([0] + engines)
    is_trainer, ei = rank in trainers, rank - SHARD_TRAINERS
    out = {"sharded": [], "one_sender": [], "full_broadcast": [], "bytes": {}}
    moved = torch.zeros(3, dtype=torch.int64)            # bytes into engines, per way

    def timed(fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    # sharded
    link = sync.P2PTransport(trainers, engines)
    full0 = _shard_state(total_bytes, 0)
    if is_trainer:
        cuts = {n: _cut(t.shape[0], SHARD_TRAINERS, rank) for n, t in full0.items()}
        slices = {n: (0, a, b, tuple(full0[n].shape)) for n, (a, b) in cuts.items()}
        sender = sync.Sender(link, group=tgroup, slices=slices, bucket_bytes=4 << 20)
    else:
        cuts = {n: _cut(t.shape[0], len(engines), ei) for n, t in full0.items()}
        slices = {n: (0, a, b, tuple(full0[n].shape)) for n, (a, b) in cuts.items()}
        receiver = sync.Receiver(link, {n: full0[n][a:b].clone() for n, (a, b) in cuts.items()},
                                 slices=slices, group=egroup)
    for step in range(reps + 1):
        state = _shard_state(total_bytes, step)
        if is_trainer:
            local = {n: state[n][a:b] for n, (a, b) in cuts.items()}
            t = timed(lambda: sender.publish(local, full=step == 0))
        else:
            before = link.bytes_received + link.meta_bytes_received
            t = timed(receiver.receive)
            if step:
                moved[0] += link.bytes_received + link.meta_bytes_received - before
            bad = [n for n, (a, b) in cuts.items() if not torch.equal(receiver.params[n],
                                                                      state[n][a:b])]
            if bad:
                raise AssertionError(f"sharded: engine rank {ei} differs at step {step} "
                                     f"(v{receiver.version}): {bad[:4]}")
        out["sharded"].append(t)
    # one sender: rank 0 holds the whole model (gathering it there is not timed)
    if rank == 0 or not is_trainer:
        blink = sync.BroadcastTransport(one, src=0)
        if rank == 0:
            bsender = sync.Sender(blink, delta=True)
        elif not is_trainer:
            whole = {n: torch.empty_like(t) for n, t in full0.items()}
            breceiver = sync.Receiver(blink, whole)
    for step in range(reps + 1):
        state = _shard_state(total_bytes, step)
        if rank == 0:
            t = timed(lambda: bsender.publish(state, full=step == 0))
            if step:
                moved[1] += bsender.last_stats.payload_bytes * len(engines)
        elif not is_trainer:
            t = timed(breceiver.receive)
        else:
            t = timed(lambda: None)
        out["one_sender"].append(t)
    # full broadcast of every tensor from rank 0
    for step in range(reps + 1):
        state = _shard_state(total_bytes, step)
        if rank == 0 or not is_trainer:
            def bcast():
                for t in (state if rank == 0 else whole).values():
                    dist.broadcast(t, 0, group=one)
            t = timed(bcast)
            if rank == 0 and step:
                moved[2] += sum(v.numel() * 2 for v in state.values()) * len(engines)
        else:
            t = timed(lambda: None)
        out["full_broadcast"].append(t)
    dist.all_reduce(moved)
    out["bytes"] = {"sharded": int(moved[0]) // reps, "one_sender": int(moved[1]) // reps,
                    "full_broadcast": int(moved[2]) // reps}
    out["model_bytes"] = sum(v.numel() * 2 for v in full0.values())
    if rank == 0:
        with open(f"{out_dir}/result.json", "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def bench_sharded(total_bytes, reps):
    """Rows: publish->applied seconds (median of the delta steps; first = full snapshot) and
    bytes into the engines per delta step, sharded vs one sender vs full broadcast."""
    import json
    world = SHARD_TRAINERS + SHARD_ENGINES
    with tempfile.TemporaryDirectory() as root:
        ctx = mp.start_processes(_sharded_rank, args=(world, total_bytes, reps, root),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + 900
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError("sharded sync benchmark: no result in 900 s")
        with open(os.path.join(root, "result.json")) as f:
            res = json.load(f)
    rows = []
    for way in ("sharded", "one_sender", "full_broadcast"):
        times = res[way]
        rows.append({"way": way, "model_MiB": res["model_bytes"] / 2 ** 20,
                     "first_s": times[0], "step_s": statistics.median(times[1:]),
                     "engine_bytes_per_step": res["bytes"][way]})
    base = rows[2]
    for r in rows:
        r["bytes/full_broadcast"] = r["engine_bytes_per_step"] / base["engine_bytes_per_step"]
        r["time/full_broadcast"] = r["step_s"] / base["step_s"]
    return rows


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
        sharded_rows = bench_sharded(min(total, 32 << 20), reps)
        _common.print_table(
            f"sharded publish, gloo on cpu: {SHARD_TRAINERS} trainer ranks (Shard(0)) -> one TP-"
            f"{SHARD_ENGINES} engine, bf16, {DENSITY:.0%} one-ulp steps, zstd deltas; "
            "one_sender = rank 0 holds the whole model (gathering it there not timed), "
            "BroadcastTransport delta; full_broadcast = dist.broadcast of every tensor; "
            "engine bytes = data + framing into the engine ranks", sharded_rows,
            ["way", "model_MiB", "first_s", "step_s", "time/full_broadcast",
             "engine_bytes_per_step", "bytes/full_broadcast"])
    except Exception as exc:   # reported, not hidden
        sharded_rows = None
        notes["sharded"] = f"{type(exc).__name__}: {str(exc)[:160]}"
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
            "sharded": sharded_rows,
            "notes": notes,
            "fallbacks": _dispatch.fallbacks_logged(), "environment": _common.environment()}


if __name__ == "__main__":
    if "--sharded-only" in sys.argv:
        print(os.popen("uptime").read().strip())
        _common.print_table("sharded publish (see run())", bench_sharded(
            (8 << 20) if "--quick" in sys.argv else (32 << 20), 3 if "--quick" in sys.argv
            else 5), ["way", "model_MiB", "first_s", "step_s", "time/full_broadcast",
                      "engine_bytes_per_step", "bytes/full_broadcast"])
    else:
        run(quick="--quick" in sys.argv)
