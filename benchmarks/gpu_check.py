"""One-shot GPU check (docs/design.md 5): GPU tests, then every benchmark, one JSON per run.

    python benchmarks/gpu_check.py --out "$OUT"     # on an H100/H200; under 8 minutes

On this workplace's lent H200 (Python 3.12, torch 2.11, triton 3.6, no registry): run
``benchmarks/gpu_wheels.sh`` here first, then make one device call carrying ``.whl``:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \
    python3 benchmarks/gpu_check.py --out "$OUT"

and commit the JSON it writes under ``benchmarks/results/``.

``--dry-run`` (CPU, no GPU needed; ``make test-min`` runs it on the image's stack: torch 2.11,
triton 3.6, Python 3.12, the wheels above installed the same way) does everything but the GPU
work: builds csrc/, collects the test suite, imports every benchmark, checks that each package
the image lacks comes from ``gpu_wheels.sh``, and writes and re-reads the JSON. It exits
non-zero on the first thing that would spend a GPU lease on set-up.

Builds csrc/ in place, runs the whole test suite (on a GPU ``kernel_backend`` is compiled
Triton on CUDA tensors and the ``gpu``-marked tests run; 240 s cap, mostly JIT compiles), then
the Megatron section (``megatron_section``: MuonSplit inside megatron-core with bf16
parameters, the layer-wise optimizer and a real forward / backward; recorded as skipped where
megatron-core is not installed), then ``run()`` of every ``benchmarks/bench_*.py``; writes ``gpu_check_<gpu>_<date>.json`` under
--out after every section (commit it under benchmarks/results/). The ahead-of-time report
needs no GPU and is not repeated here.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
import math
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402


def _build_host_extension(root: str) -> dict:
    """Compile csrc/ in place (the image has pybind11 and a compiler); a failure is recorded."""
    if not glob.glob(os.path.join(root, "csrc", "*.cpp")):
        return {"skipped": "no csrc sources"}
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root,
                          capture_output=True, text=True, timeout=180)
    return {"returncode": proc.returncode, "tail": (proc.stdout + proc.stderr)[-1500:]}


# Imported by the benchmarks, absent from the GPU image: each must come from gpu_wheels.sh.
BEYOND_IMAGE = {"zstandard": "zstandard", "liger_kernel": "liger-kernel"}


def _dry_run_checks(root: str, benches: list) -> dict:
    """What a GPU run would need before its first kernel, checked on the CPU."""
    checks = {}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "tests"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    checks["tests_collect"] = {"returncode": proc.returncode,
                               "tail": proc.stdout[-600:] + proc.stderr[-600:]}
    for name in benches:
        try:
            module = importlib.import_module(name)
            checks[name] = "ok" if callable(getattr(module, "run", None)) else "no run()"
        except Exception:
            checks[name] = traceback.format_exc()[-1500:]
    with open(os.path.join(HERE, "gpu_wheels.sh")) as f:
        wheel_script = f.read()
    for module_name, wheel in BEYOND_IMAGE.items():
        try:
            importlib.import_module(module_name)
            importable = True
        except Exception:
            importable = False
        checks[f"wheel:{wheel}"] = ("ok" if importable and wheel in wheel_script else
                                    f"importable={importable}, in gpu_wheels.sh="
                                    f"{wheel in wheel_script}")
    checks["ok"] = (checks["tests_collect"]["returncode"] == 0
                    and all(v == "ok" for k, v in checks.items()
                            if k not in ("tests_collect", "ok")))
    return checks


# --------------------------------------------------------------------------- Megatron (GPU only)
# What tests/integrations/test_megatron*.py cannot run on CPU / gloo (docs/megatron.md):
# bf16 parameters under the layer-wise distributed optimizer (Float16OptimizerWithFloat16Params,
# fp32 main params), DDP with Megatron's shard-aligned layer-wise buffers beside the byte-range
# DistributedOptimizer that takes the Adam groups, and a real forward / backward. Needs
# megatron-core 0.19.2 and emerging-optimizers 0.3.0 on the machine (not on the lent image:
# carry their wheels, Python 3.12); otherwise the section records why it was skipped.
MEGATRON_WHEELS = "megatron-core==0.19.2 emerging-optimizers==0.3.0 absl-py"


def megatron_section(steps: int = 6) -> dict:
    """A 2-layer GQA GPTModel (bf16, DDP, layer-wise optimizer, one NCCL rank) trained
    ``steps`` steps from the same weights and tokens with Megatron's ``muon``
    (muon_split_qkv=False), ``muon_split`` (muon_split_qkv=False: the same update, so the
    same losses within bf16 rounding) and ``muon_split`` per head; records the losses, the
    optimizer classes Megatron built and the step time."""
    import torch
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    try:
        import emerging_optimizers  # noqa: F401
        from megatron.core import parallel_state, tensor_parallel
    except ImportError as exc:
        return {"skipped": f"{exc}; install {MEGATRON_WHEELS}"}
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.layer_wise_optimizer import (LayerWiseDistributedOptimizer,
                                                              tag_params_for_buffer_routing)
    from megatron.core.transformer.transformer_config import TransformerConfig

    from glm_kernels.integrations import megatron as glm_megatron
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1)
    glm_megatron.register()
    vocab, seq, batch = 1024, 128, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device="cuda", generator=gen)
    position_ids = torch.arange(seq, device="cuda")[None].expand(batch, seq)
    runs = {}
    try:
        for label, name, split in (("megatron_muon", "muon", False),
                                   ("muon_split_whole", "muon_split", False),
                                   ("muon_split_per_head", "muon_split", True)):
            torch.manual_seed(1234)
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8,
                                       num_query_groups=2, kv_channels=32, ffn_hidden_size=512,
                                       bf16=True, params_dtype=torch.bfloat16)
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                             vocab_size=vocab, max_sequence_length=seq,
                             position_embedding_type="rope").cuda()
            # Megatron's layer-wise wiring (megatron/training: wrap_model_chunks_with_ddp)
            ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                       grad_reduce_in_fp32=True)
            tag_params_for_buffer_routing([model])
            layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
                [p for p in model.parameters() if p.requires_grad], ddp_config.bucket_size,
                1, ddp_config)
            model = DistributedDataParallel(config, ddp_config, model, full_param_layout=layout)
            optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer=name, lr=3e-3, weight_decay=0.01, bf16=True, clip_grad=1.0,
                use_layer_wise_distributed_optimizer=True, muon_split_qkv=split,
                muon_tp_mode="duplicated"), [model])
            losses, times = [], []
            for _ in range(steps):
                model.zero_grad_buffer()
                optimizer.zero_grad()
                loss = model(tokens[:, :-1].contiguous(), position_ids, None,
                             labels=tokens[:, 1:].contiguous()).float()
                loss = loss.mean()
                loss.backward()
                model.finish_grad_sync()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ok, _, _ = optimizer.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                losses.append(float(loss))
                if not ok:
                    raise RuntimeError(f"{label}: Megatron reported a failed step")
            runs[label] = {"losses": losses, "optimizer": type(optimizer).__name__,
                           "chained": [type(o).__name__ for o in
                                       getattr(optimizer, "chained_optimizers", [])],
                           "median_step_ms": round(1e3 * sorted(times)[len(times) // 2], 3)}
            del model, optimizer
    finally:
        parallel_state.destroy_model_parallel()
    ours, theirs = runs["muon_split_whole"]["losses"], runs["megatron_muon"]["losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    per_head = runs["muon_split_per_head"]["losses"]
    runs["whole_vs_megatron_max_rel_loss_diff"] = worst
    runs["ok"] = bool(worst < 1e-2 and all(math.isfinite(x) for x in per_head)
                      and per_head[-1] < per_head[0])
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated bench names (default all)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: everything but the GPU sections (see the docstring)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch
    root = os.path.dirname(HERE)
    result = {"env": _common.environment(), "sections": {}}
    gpu = (result["env"].get("gpu") or "cpu").replace(" ", "_")
    path = os.path.join(args.out, f"gpu_check_{gpu}_{result['env']['date'][:10]}.json")
    started = time.time()

    def save():
        # Written after every section: a run cut short by the lease still leaves its figures.
        from glm_kernels import _dispatch
        result["fallbacks_logged"] = _dispatch.fallbacks_logged()
        result["total_seconds"] = round(time.time() - started, 1)
        _common.write_json(path, result)

    result["sections"]["build"] = _build_host_extension(root)
    save()
    benches = sorted(f[:-3] for f in os.listdir(HERE)
                     if f.startswith("bench_") and f.endswith(".py"))
    if args.dry_run:
        result["dry_run"] = _dry_run_checks(root, benches)
        save()
        with open(path) as f:
            written = json.load(f)
        ok = (result["dry_run"]["ok"] and result["sections"]["build"].get("returncode", 0) == 0
              and written["dry_run"] == result["dry_run"] and "env" in written)
        print(json.dumps(written["dry_run"], indent=1)[:4000])
        print(f"dry run {'passed' if ok else 'FAILED'}; wrote {path}")
        return 0 if ok else 1
    if not args.skip_tests:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests"],
                              cwd=root, capture_output=True, text=True, timeout=240)
        result["sections"]["tests"] = {"returncode": proc.returncode,
                                       "tail": proc.stdout[-3000:] + proc.stderr[-1000:]}
        print(proc.stdout[-2000:])
        save()
    if not args.only or "megatron" in args.only.split(","):
        t0 = time.time()
        try:
            result["sections"]["megatron"] = megatron_section()
        except Exception:
            result["sections"]["megatron"] = {"error": traceback.format_exc()[-3000:]}
            print(result["sections"]["megatron"]["error"])
        result["sections"]["megatron_seconds"] = round(time.time() - t0, 1)
        save()
    if args.only:
        wanted = set(args.only.split(","))
        benches = [b for b in benches if b in wanted or b[len("bench_"):] in wanted]
    for name in benches:
        t0 = time.time()
        try:
            module = importlib.import_module(name)
            result["sections"][name] = module.run(quick=False)
        except Exception:
            result["sections"][name] = {"error": traceback.format_exc()[-3000:]}
            print(result["sections"][name]["error"])
        result["sections"][name + "_seconds"] = round(time.time() - t0, 1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
