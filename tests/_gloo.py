"""Spawn gloo ranks for a test and collect one JSON verdict dict per rank.

Each rank runs ``body(rank, world, out_dir) -> dict`` inside a gloo group and writes the dict
before the group is torn down; the parent reads the dicts. Two sources of flakiness are out of
the picture that way: rendezvous is a file in the test's temporary directory (a free TCP port
picked by one process can be taken by another before the ranks bind it), and a crash while
gloo tears down (a peer closing its sockets first can abort the other process; seen under
load) cannot fail a test whose ranks all finished and reported.
"""
import json
import multiprocessing
import os
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

SPAWN_TIMEOUT_S = 300
# A rank forks from one server process that imported these once, where a spawned rank
# imported torch again (seconds per rank on a loaded 2-core machine, for every test's world).
# The server is started by this process's first run, so it holds the environment of then:
# each rank takes the caller's environment of its own call. glm_kernels is not preloaded: it
# reads its environment variables when imported, which a rank does after taking them.
PRELOAD = ["torch", "torch.distributed", "triton"]
# Once every rank has reported, how long they may take to leave before they are killed
# (gloo's teardown and the interpreter's exit change no verdict).
EXIT_GRACE_S = 1.0


def _rank_main(rank: int, body, world: int, out_dir: str, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        verdicts = body(rank, world, out_dir)
    except Exception:
        verdicts = {"__rank__": traceback.format_exc(limit=8)}
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(verdicts, f)
    os.replace(path + ".tmp", path)
    try:                      # every rank has reported; nothing below can change a verdict
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(body, world: int, out_dir, what: str) -> list:
    """``body(rank, world, out_dir)`` (a module-level function returning a JSON-able dict)
    in ``world`` spawned gloo ranks; returns the per-rank dicts. Fails the test if a rank
    exits without reporting, or if the ranks time out twice: a run that hangs with ranks
    unreported (seen once, on a loaded machine, beside torch 2.4) is started again once in a
    fresh directory, with a warning that says so."""
    out_dir = str(out_dir)
    for attempt in (1, 2):
        run_dir = out_dir if attempt == 1 else os.path.join(out_dir, "retry")
        os.makedirs(run_dir, exist_ok=True)
        outcome = _spawn_and_wait(body, world, run_dir)
        if outcome != "timeout":
            break
        if attempt == 2:
            pytest.fail(f"{what} workers (world {world}) timed out twice")
        warnings.warn(f"{what} workers (world {world}) timed out after {SPAWN_TIMEOUT_S} s "
                      "with ranks unreported; running them once more")
    return _collect(run_dir, world, what)


def _spawn_and_wait(body, world: int, run_dir: str) -> str:
    """"reported" once every rank has reported (a rank still in gloo's teardown EXIT_GRACE_S
    later is killed: nothing it does then can change a verdict), "exited" if the ranks ended
    without all reporting, "timeout" after SPAWN_TIMEOUT_S."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    context = torch.multiprocessing.start_processes(
        _rank_main, args=(body, world, run_dir, dict(os.environ)), nprocs=world, join=False,
        start_method="forkserver")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    all_reported_at = None
    outcome = "exited"
    while any(p.is_alive() for p in context.processes):
        now = time.monotonic()
        if all_reported_at is None and all(
                os.path.exists(os.path.join(run_dir, f"rank{r}.json")) for r in range(world)):
            all_reported_at = now
        if all_reported_at is not None and now > all_reported_at + EXIT_GRACE_S:
            break
        if now > deadline:
            outcome = "timeout"
            break
        time.sleep(0.2)
    for process in context.processes:         # only the processes this test started
        if process.is_alive():
            process.kill()
    if all(os.path.exists(os.path.join(run_dir, f"rank{r}.json")) for r in range(world)):
        return "reported"
    return outcome


def _collect(out_dir: str, world: int, what: str) -> list:
    per_rank = []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            pytest.fail(f"{what}: rank {rank} exited before reporting")
        with open(path) as f:
            verdicts = json.load(f)
        assert "__rank__" not in verdicts, f"{what}: rank {rank} raised:\n{verdicts['__rank__']}"
        per_rank.append(verdicts)
    return per_rank
