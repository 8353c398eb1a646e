"""One-shot GPU check (DESIGN 5): GPU tests, then every benchmark, one JSON per run.

    python benchmarks/gpu_check.py --out "$OUT"     # on an H100/H200; under 8 minutes

Runs ``pytest -m gpu`` plus the whole suite with the triton backend, the ahead-of-time
report, and ``run()`` of every ``benchmarks/bench_*.py``; writes
``gpu_check_<gpu>_<date>.json`` under --out (commit it under benchmarks/results/).
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    import torch
    result = {"env": _common.environment(), "sections": {}}
    started = time.time()
    if not args.skip_tests:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests"],
                              cwd=os.path.dirname(HERE), capture_output=True, text=True,
                              timeout=240)
        result["sections"]["tests"] = {"returncode": proc.returncode,
                                       "tail": proc.stdout[-3000:] + proc.stderr[-1000:]}
        print(proc.stdout[-2000:])
    benches = sorted(f[:-3] for f in os.listdir(HERE)
                     if f.startswith("bench_") and f.endswith(".py"))
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
    result["total_seconds"] = round(time.time() - started, 1)
    gpu = (result["env"].get("gpu") or "cpu").replace(" ", "_")
    path = os.path.join(args.out, f"gpu_check_{gpu}_{result['env']['date'][:10]}.json")
    _common.write_json(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
