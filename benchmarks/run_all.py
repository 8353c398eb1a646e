"""Run every benchmarks/bench_*.py ``run()`` on this machine and print their tables."""
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

if __name__ == "__main__":
    quick = "--quick" in sys.argv
    for name in sorted(f[:-3] for f in os.listdir(HERE) if f.startswith("bench_")):
        print(f"\n=== {name}")
        importlib.import_module(name).run(quick=quick)
