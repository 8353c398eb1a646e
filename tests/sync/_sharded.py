"""Bodies of the sharded-sync gloo worlds (module level: ``spawn`` imports them by name).

A world has T trainer ranks (0..T-1) and three engine ranks: engine A holds whole tensors
(TP 1, rank T) and engine B is TP 2 (ranks T+1, T+2) with uneven slices, along dim 0 for
some tensors and dim 1 for others, so that its pieces cross the trainers' Shard(0) cuts.
Every rank computes the full master state of every step from the seed, so each can check
what it holds bitwise.
"""
import os

import torch
import torch.distributed as dist

BLOCK = (128, 128)
# name: (full shape, dtype, trainer-sharded?, engine B's dim (None: whole))
MODEL = {
    "emb.weight": ((300, 16), torch.bfloat16, True, 0),
    "layer.0.wo": ((29, 50), torch.bfloat16, True, 1),
    "layer.0.wq.weight": ((400, 256), torch.bfloat16, True, 1),      # published in FP8
    "layer.0.norm": ((37,), torch.float32, False, None),             # replicated
    "step": ((), torch.int64, False, None),                          # 8-byte, 0-dim
}
FP8_NAMES = ["layer.0.wq.weight"]
# trainer row cuts per trainer count (uneven; FP8 weight cuts on 128-row blocks)
CUTS = {2: {"emb.weight": [0, 130, 300], "layer.0.wo": [0, 11, 29],
            "layer.0.wq.weight": [0, 256, 400]},
        3: {"emb.weight": [0, 90, 200, 300], "layer.0.wo": [0, 1, 20, 29],
            "layer.0.wq.weight": [0, 128, 256, 400]},
        4: {"emb.weight": [0, 50, 51, 200, 300], "layer.0.wo": [0, 7, 14, 21, 29],
            "layer.0.wq.weight": [0, 128, 256, 384, 400]}}
ENGINE_B = {"emb.weight": [0, 170, 300], "layer.0.wo": [0, 21, 50],
            "layer.0.wq.weight": [0, 128, 256]}
DENSITY = 0.02


def master_at(step: int):
    """The trainer's full master weights after ``step`` optimizer steps (0: initial)."""
    g = torch.Generator().manual_seed(1234)
    state = {}
    for name, (shape, dtype, _, _) in MODEL.items():
        if dtype.is_floating_point:
            state[name] = (torch.randn(shape, generator=g) * 0.05).to(dtype)
        else:
            state[name] = torch.randint(0, 100, shape, generator=g, dtype=dtype)
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed(s)
        for name, t in state.items():
            if t.dtype == torch.int64:
                t += 1
                continue
            bits = t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
            mask = torch.rand(bits.numel(), generator=g) < DENSITY
            bits[mask] += 1                                        # one ulp
    return state


def published(state):
    """What engines hold: bf16/fp32/int64 as is, FP8 names quantized (weight + scale_inv)."""
    from glm_kernels.sync import quantize_fp8_blocks
    out = {}
    for name, t in state.items():
        if name in FP8_NAMES:
            q, s = quantize_fp8_blocks(t, BLOCK)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = t
    return out


def trainer_shards(state, rank: int, world: int):
    """(local tensors, slices) of trainer ``rank``: Shard(0) cuts, replicated tensors whole."""
    cuts = CUTS[world]
    local, slices = {}, {}
    for name, t in state.items():
        if MODEL[name][2]:
            a, b = cuts[name][rank], cuts[name][rank + 1]
            local[name] = t[a:b].clone()
            slices[name] = (0, a, b, tuple(t.shape))
        else:
            local[name] = t.clone()
    return local, slices


def engine_slices(held, part):
    """Engine B rank ``part`` (0/1) slices of the published names (None: engine A)."""
    if part is None:
        return {}
    slices = {}
    for name, t in held.items():
        base = name[:-len("_scale_inv")] if name.endswith("_scale_inv") else name
        dim = MODEL[base][3]
        if dim is None:
            continue
        cut = ENGINE_B[base]
        if name.endswith("_scale_inv"):
            cut = [c // BLOCK[dim] for c in cut]
        slices[name] = (dim, cut[part], cut[part + 1], tuple(t.shape))
    return slices


def take(t, spec):
    if spec is None:
        return t
    dim, a, b, _ = spec
    return t.narrow(dim, a, b - a)


def changed_in_slice(old, new, slices):
    n = 0
    for name in new:
        a, b = take(old[name], slices.get(name)), take(new[name], slices.get(name))
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        n += int((a.contiguous().view(ints[a.element_size()])
                  != b.contiguous().view(ints[b.element_size()])).sum())
    return n


def bitwise_equal(params, expected, slices):
    bad = []
    for name, t in params.items():
        want = take(expected[name], slices.get(name)).contiguous()
        if not torch.equal(t.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
            bad.append(name)
    return bad


def resent_pieces(rank, trainers, sender, transport, step):
    """How many of trainer ``rank``'s pieces of ``step`` are cut for a box of engine B (the
    engine that refuses): the pieces a targeted resync re-sends in full."""
    from glm_kernels.sync import layout, sharded
    held = published(master_at(0))
    prefixes = set()
    for part in (0, 1):
        slices = engine_slices(held, part)
        params = {n: take(t, slices.get(n)) for n, t in held.items()}
        prefixes |= {layout.target_prefix(n, full, box)
                     for n, (full, box) in layout.targets_of(params, slices).items()}
    local, slices = trainer_shards(master_at(step), rank, trainers)
    tensors = sharded.resolve(local, slices, sender.fp8, rank, sender.chunk_bytes)
    return sum(name[:name.rindex("/") + 1] in prefixes for _, name, _, _ in
               sharded.pieces(tensors, transport.targets(), sender.chunk_bytes))


def _roles(rank, trainers):
    if rank < trainers:
        return "trainer", None
    return "engine", (None if rank == trainers else rank - trainers - 1)


def world_body(trainers, rank, world, out_dir, ipc=None):
    """Disk, then P2P (or, given ``ipc``, an ``IpcTransport.sharded`` links: IPC only): v1
    full, three sparse delta steps, then the two faults (trainer rank dying mid-version +
    restarting without a base, an engine rank refusing)."""
    from glm_kernels import sync
    from glm_kernels.sync import sharded
    role, part = _roles(rank, trainers)
    tgroup = dist.new_group(list(range(trainers)))
    egroup = dist.new_group([trainers + 1, trainers + 2])
    verdict = {}
    for kind in ("disk", "p2p") if ipc is None else ("ipc",):
        log = verdict.setdefault(kind, [])

        def link():
            if kind == "ipc":
                return ipc.sender(rank) if rank < trainers else ipc.receiver(rank - trainers)
            if kind == "disk":
                return sync.DiskTransport(os.path.join(out_dir, "disk"), full_every=100,
                                          poll_interval=0.01)
            return sync.P2PTransport(list(range(trainers)), [trainers, trainers + 1,
                                                             trainers + 2])
        transport = link()
        fp8 = sync.FP8Blocks(block=BLOCK, names=FP8_NAMES)
        if role == "trainer":
            sender = sync.Sender(transport, group=tgroup, fp8=fp8, encoding="gap16",
                                 bucket_bytes=16384)
        else:
            # zeros by bytes: torch 2.4 cannot fill a float8 tensor
            held = {n: torch.zeros(t.shape, dtype=torch.uint8).view(t.dtype)
                    if t.dtype == torch.float8_e4m3fn else torch.zeros_like(t)
                    for n, t in published(master_at(0)).items()}
            slices = engine_slices(held, part)
            params = {n: take(t, slices.get(n)).contiguous() for n, t in held.items()}
            receiver = sync.Receiver(transport, params, slices=slices,
                                     group=egroup if part is not None else None)
        dist.barrier()      # every layout declared before the first publish

        def step_trainer(step, fail=False):
            local, slices = trainer_shards(master_at(step), rank, trainers)
            sender.slices = slices
            try:
                version = sender.publish(local)
                out = ("ok", version, sender.last_stats.full, sender.last_stats.delta_tensors,
                       sender.last_stats.tensors)
            except Exception as exc:     # noqa: BLE001 (the fault steps: recorded, checked)
                out = ("error", type(exc).__name__, str(exc)[:200])
            if kind == "disk":
                dist.barrier()       # published ...
                dist.barrier()       # ... and every engine polled (and maybe asked for full)
            return out

        def step_engine(step):
            if kind == "disk":
                dist.barrier()
            before = {n: t.clone() for n, t in receiver.params.items()}
            sent = getattr(transport, "bytes_received", getattr(transport, "bytes_read", 0))
            error = None
            try:
                receiver.poll()
            except sync.SyncError as exc:
                error = str(exc)[:200]
            if kind == "disk":
                dist.barrier()
            moved = getattr(transport, "bytes_received", getattr(transport, "bytes_read", 0))
            st = receiver.last_stats
            return {"version": receiver.version, "error": error,
                    "changed": st.changed if st else None,
                    "payload": st.payload_bytes if st else None,
                    "pieces": st.tensors if st else None,
                    "transport_bytes": moved - sent,
                    "unchanged": not bitwise_equal(receiver.params, before, {}),
                    "slices": {n: list(s[:3]) for n, s in slices.items()}}

        def check_engine(rec, step):
            expected = published(master_at(step))
            rec["bad"] = bitwise_equal(receiver.params, expected, slices)
            if step:
                rec["expected_changed"] = changed_in_slice(published(master_at(step - 1)),
                                                           expected, slices)
            return rec

        # v1 full, then 3 deltas
        for step in range(4):
            if role == "trainer":
                log.append(step_trainer(step))
            else:
                log.append(check_engine(step_engine(step), step))
        # fault 1: trainer rank 1 dies half-way through step 4 (its third piece)
        if role == "trainer":
            if rank == 1:
                real, calls = sharded.encode, []

                def dies(*a, **k):
                    calls.append(1)
                    if len(calls) == 3:
                        raise RuntimeError("trainer rank 1 died mid-version")
                    return real(*a, **k)
                sharded.encode = dies
            log.append(step_trainer(4))
            if rank == 1:
                sharded.encode = real
            if rank == 1:            # restarted without a base: its shards go full
                sender = sync.Sender(transport, group=tgroup, fp8=fp8, encoding="gap16",
                                     bucket_bytes=16384)
            log.append(step_trainer(5))
        else:
            rec = step_engine(4)
            rec["bad_vs_previous"] = bitwise_equal(receiver.params,
                                                   published(master_at(3)), slices)
            log.append(rec)
            log.append(check_engine(step_engine(5), 5))
        # fault 2: engine B rank 1 drifts (a flipped bit), refuses step 6: engine B stays;
        # step 7 recovers: full pieces for engine B's boxes only, deltas for the rest
        if role == "trainer":
            log.append(step_trainer(6))
            log.append(step_trainer(7) + (resent_pieces(rank, trainers, sender, transport, 7),))
        else:
            if part == 1:                # a flipped bit in its slice of emb.weight
                receiver.params["emb.weight"].view(-1).view(torch.uint8)[0] ^= 1
            rec = step_engine(6)
            rec["bad_vs_previous"] = bitwise_equal(receiver.params,
                                                   published(master_at(5)), slices)
            log.append(check_engine(rec, 6))
            rec = check_engine(step_engine(7), 7)
            # engine B slices these names; the others' pieces (whole boxes) are engine B's too
            sliced = set(engine_slices(receiver.params, 0) if part is None else slices)
            rec["expected_changed_sliced"] = changed_in_slice(
                {n: t for n, t in published(master_at(6)).items() if n in sliced},
                {n: t for n, t in published(master_at(7)).items() if n in sliced}, slices)
            rec["held_bytes"] = sum(t.numel() * t.element_size()
                                    for t in receiver.params.values())
            log.append(rec)
        dist.barrier()
        if kind == "disk":
            transport.close()
    if trainers == 2 and DTENSOR_API and ipc is None:
        verdict["dtensor"] = dtensor_steps(trainers, rank, out_dir, tgroup, egroup)
    return verdict


def _has_public_dtensor() -> bool:
    try:
        from torch.distributed.tensor import Replicate, Shard  # noqa: F401
    except ImportError:
        return False
    return True


# sync takes DTensors from torch 2.5 (public torch.distributed.tensor); older: slices= only
DTENSOR_API = _has_public_dtensor()


def dtensor_steps(trainers, rank, out_dir, tgroup, egroup):
    """Trainers publish DTensors (Shard(0) on a 1-D mesh of the trainer group, torch's own
    uneven chunking; Replicate for the norm) over disk; engines as above (no FP8)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from glm_kernels import sync
    names = ["emb.weight", "layer.0.wo", "layer.0.norm"]
    role, part = _roles(rank, trainers)
    transport = sync.DiskTransport(os.path.join(out_dir, "dtensor"), poll_interval=0.01)
    log = []
    if role == "trainer":
        mesh = DeviceMesh.from_group(tgroup, "cpu")
        sender = sync.Sender(transport, group=tgroup, encoding="gap16", bucket_bytes=4096)
    else:
        held = {n: torch.zeros_like(master_at(0)[n]) for n in names}
        slices = engine_slices(held, part)
        params = {n: take(t, slices.get(n)).contiguous() for n, t in held.items()}
        receiver = sync.Receiver(transport, params, slices=slices,
                                 group=egroup if part is not None else None)
    dist.barrier()
    for step in range(2):
        if role == "trainer":
            state = master_at(step)
            named = {n: distribute_tensor(state[n], mesh, [Replicate() if n == "layer.0.norm"
                                                           else Shard(0)]) for n in names}
            log.append(sender.publish(named))
            dist.barrier()
            dist.barrier()
        else:
            dist.barrier()
            receiver.poll()
            dist.barrier()
            log.append((receiver.version, bitwise_equal(receiver.params, master_at(step),
                                                        slices)))
    transport.close()
    return log

