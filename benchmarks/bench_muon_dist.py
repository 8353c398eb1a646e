"""Sharded MuonSplit (FSDP2 / DTensor Shard(0)): bytes moved per step by owner-compute vs
gathering every matrix on every rank, FLOP balance, and CPU gloo step time at a scaled shape.

Bytes (exact, from the plan every rank builds; no processes): one GLM-5 attention layer --
q_b 16384 x 2048 as 64 heads [192, 64], kv_b 28672 x 512 as 64 heads [192, 256], o_proj
6144 x 16384 -- row-sharded over ``world`` ranks. Owner-compute moves the rows of the momentum
update U (fp32) that the owner lacks to the owner, and the same rows of O back (fp32 on the
torch path; bf16 on the Triton path, shown as its own column). The baseline gathers every
matrix on every rank (what DTensor's ``full_tensor()`` or an all-gather-then-NS Muon does):
(W - 1) M bytes per matrix. Goal: 0 for head-split matrices whose heads align with shards,
at most 2 / W of the baseline for the rest. World 8 aligns (64 heads / 8); world 6 does not.

Timing (CPU, gloo, spawned processes: labelled CPU, not a GPU figure): the same layer scaled
down (16 heads [24, 8] x 256, 16 heads [24, 32] x 64, o_proj 768 x 512), one optimizer step:
sharded MuonSplit vs the gather-everything baseline (all_gather of every gradient, every rank
runs one-process MuonSplit on the full matrices) vs one process alone on the full matrices.

    python benchmarks/bench_muon_dist.py [--quick] [--cpu] [--json out.json] [--world N]

``--quick``: world 4, 3 repeats (default world 8, 7 repeats). ``--cpu`` is accepted like every
bench's; the timing here is always CPU gloo (a GPU step time needs two or more GPUs and NCCL:
not measured).
"""
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from glm_kernels.muon import HeadSplit  # noqa: E402
from glm_kernels.muon import sharded  # noqa: E402

GOALS = ("0 bytes for head-split matrices whose heads align with shards; owner-compute "
         "<= 2/world of the gather-everything volume for the rest")
GLM5_LAYER = [("q_b", 16384, 2048, HeadSplit(64, [192, 64])),
              ("kv_b", 28672, 512, HeadSplit(64, [192, 256])),
              ("o_proj", 6144, 16384, None)]
SCALED_LAYER = [("q_b", 16 * 32, 256, HeadSplit(16, [24, 8])),
                ("kv_b", 16 * 56, 64, HeadSplit(16, [24, 32])),
                ("o_proj", 768, 512, None)]


def moved_bytes(rows, cols, split, world, in_size=4, out_size=4):
    """(owner-compute bytes in, out, gather-everything bytes, max/mean NS FLOPs per rank)."""
    ranges = sharded.chunk_ranges(rows, world)
    plan = sharded.plan_group(((rows, cols, ranges),), split, 5, 0, world)
    moved_rows = sum(b - a for item in plan.items for _, a, b in item.pieces)
    naive = sum(rows - (b - a) for a, b in ranges) * cols * in_size
    loads = plan.loads
    balance = max(loads) / (sum(loads) / world) if sum(loads) else 1.0
    return moved_rows * cols * in_size, moved_rows * cols * out_size, naive, balance


def byte_table(worlds=(8, 6)):
    rows_out = []
    for world in worlds:
        for name, rows, cols, split in GLM5_LAYER:
            moved_in, moved_out, naive, balance = moved_bytes(rows, cols, split, world)
            bf16_out = moved_out // 2
            rows_out.append({
                "world": world, "matrix": name, "shape": f"{rows}x{cols}",
                "split": f"{split.num_heads}x{list(split.block_rows)}" if split else "-",
                "owner_MB": (moved_in + moved_out) / 1e6,
                "owner_bf16_out_MB": (moved_in + bf16_out) / 1e6,
                "gather_all_MB": naive / 1e6,
                "ratio": (moved_in + moved_out) / naive,
                "goal_ratio": 0.0 if split and split.num_heads % world == 0 else 2 / world,
                "flops_max_over_mean": balance})
    return rows_out


def balance_table(worlds=(8, 6), layers=8):
    """Owner-compute FLOP balance of one plain Muon group of ``layers`` GLM-5 layers' q_a
    (2048 x 6144), kv_a (576 x 6144) and o_proj (6144 x 16384): max / mean NS FLOPs per rank
    (1 is perfect; one lone matrix cannot be split, so a group needs many)."""
    shapes = [(2048, 6144), (576, 6144), (6144, 16384)] * layers
    out = []
    for world in worlds:
        plan = sharded.plan_group(tuple((r, c, sharded.chunk_ranges(r, world)) for r, c in shapes),
                                  None, 5, 0, world)
        out.append({"world": world, "matrices": len(shapes),
                    "flops_max_over_mean": max(plan.loads) / (sum(plan.loads) / world),
                    "owner_bytes_over_gather_all": 2 * sum(
                        (b - a) * shapes[item.index][1] for item in plan.items
                        for _, a, b in item.pieces) / sum((world - 1) * r * c
                                                          for r, c in shapes)})
    return out


# --------------------------------------------------------------------------- CPU timing
def _layer_model(layer):
    model = torch.nn.Module()
    for name, rows, cols, _ in layer:
        model.register_parameter(name, torch.nn.Parameter(torch.randn(rows, cols) * 0.02))
    return model


def _groups(model, layer):
    groups = [{"params": [getattr(model, n)], "head_split": s} for n, _, _, s in layer if s]
    groups.append({"params": [getattr(model, n) for n, _, _, s in layer if s is None]})
    return groups


def _rank(rank, world, out_dir, repeats, layer):
    import torch.distributed as dist
    from glm_kernels import force_backend
    from glm_kernels.optim import MuonSplit
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rdv')}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=300))
    api = sharded.dtensor_api()
    mesh = api.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = _layer_model(layer)
    grads = {n: torch.randn(p.shape) for n, p in full.named_parameters()}
    shard = _layer_model(layer)
    shard.load_state_dict(full.state_dict())
    api.fully_shard(shard, mesh=mesh)
    opt_sharded = MuonSplit(_groups(shard, layer), lr=0.02)
    opt_gather = MuonSplit(_groups(full, layer), lr=0.02)

    def step_sharded():
        for n, p in shard.named_parameters():
            rows = sharded.chunk_ranges(p.shape[0], world)[rank]
            p.grad = api.DTensor.from_local(grads[n][slice(*rows)], mesh, p.placements,
                                            run_check=False, shape=p.shape, stride=p.stride())
        opt_sharded.step()

    def step_gather():
        # the baseline: every rank gathers every gradient and steps every full matrix
        for n, p in full.named_parameters():
            rows = sharded.chunk_ranges(p.shape[0], world)
            pieces = [torch.empty(b - a, p.shape[1]) for a, b in rows]
            dist.all_gather(pieces, grads[n][slice(*rows[rank])].contiguous())
            p.grad = torch.cat(pieces)
        opt_gather.step()

    result = {}
    with force_backend("torch"):
        for label, fn in (("sharded", step_sharded), ("gather_all", step_gather)):
            fn()                                  # warm-up (plans, buffers)
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times.append(time.perf_counter() - t0)
            result[label] = sorted(times)[len(times) // 2]
        result["sharded_bytes_sent"] = opt_sharded.comm_stats["bytes_sent"]
        if rank == 0:
            alone = _layer_model(layer)
            opt_alone = MuonSplit(_groups(alone, layer), lr=0.02)
            for n, p in alone.named_parameters():
                p.grad = grads[n]
            result["one_process"] = _common.time_fn(opt_alone.step, device="cpu",
                                                    repeats=repeats)
    import json
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def cpu_timing(world, repeats):
    import json
    out_dir = tempfile.mkdtemp(prefix="bench_muon_dist_")
    torch.multiprocessing.spawn(_rank, args=(world, out_dir, repeats, SCALED_LAYER),
                                nprocs=world, join=True)
    per_rank = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]
    return {"world": world, "sharded_s": max(r["sharded"] for r in per_rank),
            "gather_all_s": max(r["gather_all"] for r in per_rank),
            "one_process_s": per_rank[0]["one_process"],
            "sharded_bytes_sent_all_ranks": sum(r["sharded_bytes_sent"] for r in per_rank)}


def run(quick=False, cpu=False, world=None):
    table = byte_table()
    _common.print_table("Bytes moved per optimizer step, one GLM-5 layer (fp32 U in; O out "
                        "fp32 on the torch path, bf16 column: Triton path)", table,
                        ["world", "matrix", "shape", "split", "owner_MB", "owner_bf16_out_MB",
                         "gather_all_MB", "ratio", "goal_ratio", "flops_max_over_mean"])
    balance = balance_table()
    _common.print_table("Owner FLOP balance, one plain Muon group of 8 GLM-5 layers "
                        "(q_a, kv_a, o_proj)", balance,
                        ["world", "matrices", "flops_max_over_mean",
                         "owner_bytes_over_gather_all"])
    world = world or (4 if quick else 8)
    timing = cpu_timing(world, 3 if quick else 7)
    _common.print_table(f"CPU gloo step time, scaled layer, world {world} (CPU, not GPU; "
                        "shared 2-core sandbox numbers are noisy)", [timing],
                        ["world", "sharded_s", "gather_all_s", "one_process_s",
                         "sharded_bytes_sent_all_ranks"])
    met = all(r["ratio"] <= r["goal_ratio"] + 1e-12 for r in table)
    print(f"goals: {GOALS}: {'met' if met else 'NOT met'}")
    return {"bytes": table, "balance": balance, "cpu_timing": timing, "goals": GOALS,
            "goals_met": met, "env": _common.environment()}


def main():
    args = _common.bench_args(__doc__, lambda parser: parser.add_argument(
        "--world", type=int, default=None, help="ranks for the CPU timing (default 8)"))
    _common.write_json(args.json, run(quick=args.quick, cpu=args.cpu, world=args.world))


if __name__ == "__main__":
    main()
