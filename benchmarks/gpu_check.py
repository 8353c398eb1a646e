"""One-shot GPU check (DESIGN 5): GPU tests, then every benchmark, one JSON per run.

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
``run()`` of every ``benchmarks/bench_*.py``; writes ``gpu_check_<gpu>_<date>.json`` under
--out after every section (commit it under benchmarks/results/). The ahead-of-time report
needs no GPU and is not repeated here.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
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
