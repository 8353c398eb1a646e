"""Spawn gloo ranks for a test and collect one JSON verdict dict per rank.

Rendezvous is a file in the test's temporary directory, not a TCP port: a free port picked
by one process can be taken by another before the ranks bind it (seen once when two test
runs shared the machine), a file path cannot.
"""
import json
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

SPAWN_TIMEOUT_S = 300


def init_gloo(rank: int, world: int, out_dir: str) -> None:
    """In a worker: join the test's gloo group (file rendezvous in ``out_dir``)."""
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))


def write_verdicts(out_dir: str, rank: int, verdicts: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(verdicts, f)


def run_ranks(worker, world: int, out_dir, what: str) -> list:
    """``worker(rank, world, out_dir)`` in ``world`` spawned processes; each must call
    ``init_gloo`` and ``write_verdicts``. Returns the per-rank verdict dicts; fails the test
    (killing only its own processes) after SPAWN_TIMEOUT_S."""
    context = torch.multiprocessing.start_processes(
        worker, args=(world, str(out_dir)), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{what} workers (world {world}) timed out")
    per_rank = []
    for rank in range(world):
        with open(os.path.join(str(out_dir), f"rank{rank}.json")) as f:
            per_rank.append(json.load(f))
    return per_rank
