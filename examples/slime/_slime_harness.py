"""Run pieces of slime's own code without Ray, Megatron or a GPU cluster.

Used by the conformance checks in this folder. Only what plain processes cannot provide is
stood in: Ray, Megatron's ``mpu`` (tensor parallel size 1; context parallel size and rank as
``set_parallel`` says, default 1 / 0; groups = the gloo WORLD unless given), Megatron's
``PackedSeqParams`` (a record), slime's accelerator shim, its import-by-path helper and the NCCL
weight-update base class (whose constructor only stores attributes). The slime files under
test are loaded from a checkout by path, so the check runs against the user's slime version.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
import types
from contextlib import contextmanager

import torch
import torch.distributed as dist

MEGATRON_UTILS = "slime.backends.megatron_utils"
UPDATE_WEIGHT = f"{MEGATRON_UTILS}.update_weight"


def stand_in(name, **attrs):
    mod = types.ModuleType(name)
    mod.__path__ = []                       # importable as a package
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def load_file(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def slime_root(slime_src: str, needs: str) -> str:
    root = os.path.join(slime_src, "slime")
    if not os.path.isfile(os.path.join(root, needs)):
        raise SystemExit(f"--slime-src {slime_src!r}: no slime/{needs} there (a THUDM/slime "
                         f"checkout, 624b824 or later)")
    return root


def _load_function(path):
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


# What the stand-in ``mpu`` answers. Context parallelism: one process per CP rank, the CP
# group = the gloo WORLD of those processes, and a one-rank TP group per process
# (``set_parallel``); a single process keeps the defaults (CP = 1, both groups = WORLD).
PARALLEL = types.SimpleNamespace(cp_size=1, cp_rank=0, cp_group=None, tp_group=None)


def set_parallel(cp_size=1, cp_rank=0, cp_group=None, tp_group=None):
    """Make the stand-in ``mpu`` report this context-parallel layout (TP stays 1)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size), got cp_rank={cp_rank}, "
                         f"cp_size={cp_size}")
    PARALLEL.__dict__.update(cp_size=cp_size, cp_rank=cp_rank, cp_group=cp_group,
                             tp_group=tp_group)


def _group(group):
    return dist.group.WORLD if group is None else group


def stand_in_runtime():
    """Packages and the process-local pieces every check needs."""
    class Stream:
        def synchronize(self):
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()

    for name in ("slime", "slime.backends", MEGATRON_UTILS, UPDATE_WEIGHT, "slime.utils",
                 "megatron", "megatron.core"):
        stand_in(name)
    stand_in("ray", get=lambda refs: refs, ObjectRef=object)
    stand_in("ray.actor", ActorHandle=object)
    sys.modules["megatron.core"].mpu = stand_in(
        "megatron.core.mpu", get_data_parallel_rank=lambda **_: 0,
        get_data_parallel_world_size=lambda with_context_parallel=False:
            PARALLEL.cp_size if with_context_parallel else 1,
        get_tensor_model_parallel_rank=lambda: 0, get_tensor_model_parallel_world_size=lambda: 1,
        get_tensor_model_parallel_group=lambda: _group(PARALLEL.tp_group),
        get_context_parallel_world_size=lambda: PARALLEL.cp_size,
        get_context_parallel_rank=lambda: PARALLEL.cp_rank,
        get_context_parallel_group=lambda: _group(PARALLEL.cp_group),
        is_pipeline_last_stage=lambda **_: True)
    stand_in("megatron.core.packed_seq_params", PackedSeqParams=types.SimpleNamespace)
    device = lambda: "cuda" if torch.cuda.is_available() else "cpu"  # noqa: E731
    sys.modules["slime.utils"].accelerator = stand_in(
        "slime.utils.accelerator", current_stream=Stream, current_device=device, device=device)
    stand_in("slime.utils.misc", load_function=_load_function)
    stand_in("slime.utils.types", RolloutBatch=dict)


def load_delta_updater(slime_src: str):
    """slime's real ``update_weight_from_disk_delta`` module (and ``disk_delta``)."""
    root = slime_root(slime_src, "utils/disk_delta.py")
    stand_in_runtime()
    stand_in("slime.utils.distributed_utils", get_gloo_group=lambda: None)

    class UpdateWeightFromDistributed:      # the NCCL base: its constructor stores attributes
        def __init__(self, args, model, weights_getter, *, model_name, quantization_config):
            self.args, self.model, self.model_name = args, model, model_name
            self.quantization_config = quantization_config
            self.weight_version = 0
            self.update_weight_metrics = {}
    stand_in(f"{UPDATE_WEIGHT}.update_weight_from_distributed",
             UpdateWeightFromDistributed=UpdateWeightFromDistributed)
    load_file("slime.utils.disk_delta", os.path.join(root, "utils", "disk_delta.py"))
    return load_file(f"{UPDATE_WEIGHT}.update_weight_from_disk_delta",
                     os.path.join(root, "backends", "megatron_utils", "update_weight",
                                  "update_weight_from_disk_delta.py"))


def load_loss(slime_src: str):
    """slime's real ``megatron_utils.loss`` (with its real ``ppo_utils`` and ``cp_utils``)."""
    root = slime_root(slime_src, "backends/megatron_utils/loss.py")
    stand_in_runtime()
    load_file("slime.utils.distributed_utils", os.path.join(root, "utils",
                                                            "distributed_utils.py"))
    load_file("slime.utils.ppo_utils", os.path.join(root, "utils", "ppo_utils.py"))
    load_file(f"{MEGATRON_UTILS}.cp_utils", os.path.join(root, "backends", "megatron_utils",
                                                         "cp_utils.py"))
    return load_file(f"{MEGATRON_UTILS}.loss", os.path.join(root, "backends", "megatron_utils",
                                                            "loss.py"))


def load_data(slime_src: str):
    """slime's real ``megatron_utils.data`` (``get_batch``, ``DataIterator``); after
    ``load_loss``, which loads the ``cp_utils`` it slices with."""
    root = slime_root(slime_src, "backends/megatron_utils/data.py")
    return load_file(f"{MEGATRON_UTILS}.data", os.path.join(root, "backends", "megatron_utils",
                                                            "data.py"))


@contextmanager
def one_rank_gloo():
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:        # gloo's file store removes its file
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def report_broken_ranks(head: str, results: list) -> bool:
    """Print one MISMATCH line naming the ranks whose check died or raised; True if any did.

    ``results``: each rank's result dict (with ``"error"`` when it raised), None where the rank
    process died before answering.
    """
    broken = [rank for rank, r in enumerate(results) if r is None or "error" in r]
    if broken:
        detail = next((results[r]["error"].strip().splitlines()[-1] for r in broken
                       if results[r]), "no result (the rank process died)")
        print(f"{head} ERROR on ranks {broken}: {detail}  MISMATCH")
    return bool(broken)
