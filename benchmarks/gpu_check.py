"""One-shot GPU check (DESIGN 5): GPU tests, then every benchmark, one JSON per run.

    python benchmarks/gpu_check.py --out "$OUT"     # on an H100/H200; under 8 minutes

On this workplace's lent H200 (Python 3.12, torch 2.11, triton 3.6, no registry): run
``benchmarks/gpu_wheels.sh`` here first, then make one device call carrying ``.whl``:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \
    python3 benchmarks/gpu_check.py --out "$OUT"

and commit the JSON it writes under ``benchmarks/results/``.

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated bench names (default all)")
    args = parser.parse_args()
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
    if not args.skip_tests:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests"],
                              cwd=root, capture_output=True, text=True, timeout=240)
        result["sections"]["tests"] = {"returncode": proc.returncode,
                                       "tail": proc.stdout[-3000:] + proc.stderr[-1000:]}
        print(proc.stdout[-2000:])
        save()
    benches = sorted(f[:-3] for f in os.listdir(HERE)
                     if f.startswith("bench_") and f.endswith(".py"))
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
