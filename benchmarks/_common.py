"""Timing, floors and tables shared by every benchmark script.

GPU timings use ``triton.testing.do_bench`` (median of CUDA-event timings after warm-up, L2
flushed between runs); CPU timings are medians of ``time.perf_counter`` over repeats.
Floors are measured in the same run: copy bandwidth (bytes / s of a large device copy) and
bf16 matmul rate, so every table can report time / floor.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Callable, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def time_fn(fn: Callable[[], object], *, device: str, warmup: int = 3, repeats: int = 10,
            min_time_s: float = 0.0, process_clock: bool = False) -> float:
    """Median seconds per call of ``fn``.

    ``process_clock`` (CPU only): time this process's CPU time (user + sys, all threads)
    instead of the wall clock. On a machine shared with other jobs the wall clock also counts
    the time the process waited for a core; comparisons between providers then say more with
    one torch thread and this clock.
    """
    if device.startswith("cuda"):
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    clock = time.process_time if process_clock else time.perf_counter
    for _ in range(warmup):
        fn()
    times = []
    start_all = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start_all < min_time_s:
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


_FLOORS: Dict[str, float] = {}


def copy_bandwidth(device: str) -> float:
    """Measured bytes/s of a read+write device copy (counting read and written bytes)."""
    key = f"bw:{device}"
    if key not in _FLOORS:
        n = (1 << 28) if device.startswith("cuda") else (1 << 24)   # 1 GiB / 64 MiB of fp32
        src = torch.randn(n, device=device)
        dst = torch.empty_like(src)
        seconds = time_fn(lambda: dst.copy_(src), device=device)
        _FLOORS[key] = 2 * src.numel() * src.element_size() / seconds
    return _FLOORS[key]


def matmul_rate(device: str) -> float:
    """Measured FLOP/s of a large bf16 (GPU) or fp32 (CPU) matmul."""
    key = f"mm:{device}"
    if key not in _FLOORS:
        n = 8192 if device.startswith("cuda") else 1024
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = time_fn(lambda: a @ b, device=device)
        _FLOORS[key] = 2 * n ** 3 / seconds
    return _FLOORS[key]


def environment() -> dict:
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = None
    return info


def print_table(title: str, rows: List[dict], columns: List[str]) -> None:
    """Print rows (dicts) as a fixed-width table; floats get 4 significant digits."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)
    widths = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) if rows else len(c)
              for c in columns}
    print(f"\n{title}")
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(fmt(r.get(c)).rjust(widths[c]) for c in columns))


def loss_grad_check(label: str, kernel_loss: Callable, reference_loss: Callable,
                    leaf: torch.Tensor) -> dict:
    """Loss and gradient of ``kernel_loss`` (run by the Triton interpreter) against
    ``reference_loss`` on the same input: both map a fresh leaf copy of ``leaf`` to a scalar
    loss. Returns and prints the relative errors ||kernel - ref|| / ||ref||."""
    from glm_kernels import _dispatch
    from glm_kernels.testing import rel_error
    out = {}
    for name, loss_fn in (("kernel", kernel_loss), ("reference", reference_loss)):
        x = leaf.detach().clone().requires_grad_(True)
        with (_dispatch.force_backend("interpret") if name == "kernel"
              else contextlib.nullcontext()):
            loss = loss_fn(x)
        loss.backward()
        out[name] = (loss.detach(), x.grad)
    errors = {"loss_rel_err": rel_error(out["kernel"][0], out["reference"][0]),
              "grad_rel_err": rel_error(out["kernel"][1], out["reference"][1])}
    print(f"\ninterpreter check, {label}: Triton kernel vs reference: loss rel err "
          f"{errors['loss_rel_err']:.2e}, grad rel err {errors['grad_rel_err']:.2e}")
    return errors


def write_json(path: Optional[str], payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1, default=str)


def bench_args(doc: str, parser_hook: Optional[Callable] = None,
               argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line every bench_*.py shares: --quick, --cpu, --json PATH (plus hook's);
    ``argv`` instead of sys.argv[1:] when a script's run() builds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json")
    if parser_hook is not None:
        parser_hook(parser)
    return parser.parse_args(argv)


def finish(result: dict, notes: Dict[str, str],
           interpreter_checks: Dict[str, Callable[[], object]]) -> dict:
    """The end of a bench's run() on any device: on the CPU with Triton's interpreter active,
    each named check runs and joins ``result``; the notes and the reference fallbacks logged
    during the run are printed (a broken kernel is never silently timed as the reference)."""
    from glm_kernels import _dispatch
    if result["device"] == "cpu" and _dispatch.interpreter_active() \
            and _dispatch.triton_available():
        for key, check in interpreter_checks.items():
            result[key] = check()
    for key, note in notes.items():
        print(f"note: {key}: {note}")
    print(f"fallbacks logged: {_dispatch.fallbacks_logged() or 'none'}")
    return result


def main(doc: str, run: Callable[..., dict]) -> None:
    """A bench script's command line: ``run(quick=, cpu=)``, its dict to ``--json`` if given."""
    args = bench_args(doc)
    write_json(args.json, run(quick=args.quick, cpu=args.cpu))
