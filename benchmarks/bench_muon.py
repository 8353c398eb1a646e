"""Muon Split Newton-Schulz: glm_kernels (standard, gram) vs the torch batched formula (eager,
torch.compile) vs the unsplit whole-matrix NS vs the FLOP floor; and one MuonSplit.step().

Cases (GPU sizes from issue 4; 5 steps, polar_express, fp32 input like a momentum buffer):
  q_b heads    64 x (256 x 2048)             HeadSplit(64, [256])
  q_b ragged   64 x ([192, 64] x 2048)       HeadSplit(64, [192, 64])
  kv_b         64 x ([192, 256] x 512)       HeadSplit(64, [192, 256])
  square       4096 x 4096                   one block (control)
Peers: the torch batched formula in bf16 (bmm / baddbmm, one batched call per block shape:
torch cannot batch unequal blocks), eager and torch.compile'd; the same formula on the whole
unsplit matrix (what plain Muon does). Floor: 5 x sum over blocks of (3 m^2 n + m^3) FLOPs
(the 4 m^2 n + 2 m^3 of a step with both symmetric products halved) over the bf16 matmul rate
measured in the same run. Then one MuonSplit.step() over one GLM-5 attention layer's matrices
(q_a, q_b split, kv_a, kv_b split, o) vs the same update written with the torch formula.
CPU runs use scaled-down shapes and the torch reference path (fp32), plus an interpreter
check of the Triton kernels against the reference.

    python benchmarks/bench_muon.py [--quick] [--cpu] [--json out.json]
    python benchmarks/bench_muon.py --accuracy     # gram vs standard precision study (CPU)
"""
from __future__ import annotations

import math
import os
import sys

if "--cpu" in sys.argv:                      # the interpreter check needs this before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import glm_kernels  # noqa: E402
from glm_kernels import _dispatch  # noqa: E402
from glm_kernels.muon import (HeadSplit, NSConfig, muon_split_orthogonalize,  # noqa: E402
                              resolve_coefficients)
from glm_kernels.muon import _reference  # noqa: E402
from glm_kernels.optim import MuonSplit, muon_param_groups  # noqa: E402

STEPS, COEFFICIENTS = 5, "polar_express"
GOALS = ("standard >= 1.4x and gram >= 2.5x faster than the torch batched formula on the "
         "per-head shapes; ragged q_b no slower than equal-block q_b")
GPU_CASES = [("q_b heads", 64, (256,), 2048), ("q_b ragged", 64, (192, 64), 2048),
             ("kv_b", 64, (192, 256), 512), ("square", 1, (4096,), 4096)]
CPU_CASES = [("q_b heads", 8, (32,), 256), ("q_b ragged", 8, (24, 8), 256),
             ("kv_b", 8, (24, 32), 64), ("square", 1, (256,), 256)]


def torch_batched_ns(X3: torch.Tensor, schedule) -> torch.Tensor:
    """The plain batched formula in bf16 (modded-nanogpt / Polar Express style)."""
    X = X3.bfloat16()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in schedule:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    return X.mT if tall else X


def torch_split_ns(G: torch.Tensor, split: HeadSplit, schedule) -> torch.Tensor:
    """Per-head NS with the torch formula: one batched call per block shape."""
    out = torch.empty_like(G)
    grouped, target = G.view(split.num_heads, split.rows_per_head, -1), \
        out.view(split.num_heads, split.rows_per_head, -1)
    start = 0
    for rows in split.block_rows:
        target[:, start:start + rows] = torch_batched_ns(grouped[:, start:start + rows],
                                                         schedule).to(G.dtype)
        start += rows
    return out


def floor_flops(split: HeadSplit, cols: int) -> float:
    total = 0.0
    for rows in split.block_rows:
        m, n = min(rows, cols), max(rows, cols)
        total += split.num_heads * (3 * m * m * n + m ** 3)
    return STEPS * total


def _providers(split, schedule, device, compile_ok):
    whole = HeadSplit(1, (split.rows,))
    providers = {
        "standard": lambda G: muon_split_orthogonalize(G, split, coefficients=COEFFICIENTS),
        "gram": lambda G: muon_split_orthogonalize(G, split, coefficients=COEFFICIENTS,
                                                   method="gram"),
        "torch_eager": lambda G: torch_split_ns(G, split, schedule),
    }
    if compile_ok:
        compiled = torch.compile(lambda G: torch_split_ns(G, split, schedule))
        providers["torch_compile"] = compiled
    providers["unsplit_torch"] = lambda G: torch_split_ns(G, whole, schedule)
    providers["unsplit_standard"] = lambda G: muon_split_orthogonalize(
        G, whole, coefficients=COEFFICIENTS)
    return providers


def bench_ns(device: str, cases, notes: dict, compiled_cases: int) -> list:
    rate = _common.matmul_rate(device)
    schedule = resolve_coefficients(COEFFICIENTS, STEPS)
    rows_out = []
    for index, (name, heads, block_rows, cols) in enumerate(cases):
        split = HeadSplit(heads, block_rows)
        gen = torch.Generator(device=device).manual_seed(0)
        G = torch.randn(split.rows, cols, device=device, generator=gen)
        floor_s = floor_flops(split, cols) / rate
        row = {"case": name, "shape": f"{heads}x({list(block_rows)}x{cols})",
               "floor_us": floor_s * 1e6}
        compile_ok = index < compiled_cases
        for provider, fn in _providers(split, schedule, device, compile_ok).items():
            try:
                seconds = _common.time_fn(lambda: fn(G), device=device)
            except Exception as exc:  # a provider that fails is reported, not hidden
                notes[f"{provider}@{name}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            row[f"{provider}_us"] = seconds * 1e6
            row[f"{provider}/floor"] = seconds / floor_s
        for ours in ("standard", "gram"):
            for peer in ("torch_eager", "torch_compile"):
                if f"{ours}_us" in row and f"{peer}_us" in row:
                    row[f"{ours}_vs_{peer}"] = row[f"{peer}_us"] / row[f"{ours}_us"]
        rows_out.append(row)
    return rows_out


def _attention_layer(device, hidden, heads, q_rank, kv_rank, nope, rope, v):
    """One GLM-5 attention layer's matrices under Hugging Face names (fp32 master weights)."""
    layer = torch.nn.Module()
    layer.q_a_proj = torch.nn.Linear(hidden, q_rank, bias=False)
    layer.q_b_proj = torch.nn.Linear(q_rank, heads * (nope + rope), bias=False)
    layer.kv_a_proj_with_mqa = torch.nn.Linear(hidden, kv_rank + rope, bias=False)
    layer.kv_b_proj = torch.nn.Linear(kv_rank, heads * (nope + v), bias=False)
    layer.o_proj = torch.nn.Linear(heads * v, hidden, bias=False)
    layer = layer.to(device)
    for p in layer.parameters():
        p.grad = torch.randn_like(p)
    return layer


def bench_step(device: str, notes: dict) -> dict:
    dims = dict(hidden=6144, heads=64, q_rank=2048, kv_rank=512, nope=192, rope=64, v=256) \
        if device == "cuda" else dict(hidden=256, heads=4, q_rank=64, kv_rank=32, nope=24,
                                      rope=8, v=32)
    layer = _attention_layer(device, **dims)
    splits = {"q_b_proj": HeadSplit(dims["heads"], (dims["nope"], dims["rope"])),
              "kv_b_proj": HeadSplit(dims["heads"], (dims["nope"], dims["v"]))}
    opt = MuonSplit(muon_param_groups(layer, splits), lr=1e-4)
    schedule = resolve_coefficients("jordan", STEPS)
    buffers = {p: torch.zeros_like(p) for p in layer.parameters()}

    def torch_step():
        """The same Muon update, blocks orthogonalized with the torch formula."""
        with torch.no_grad():
            for name, p in layer.named_parameters():
                buf = buffers[p].mul_(0.95).add_(p.grad)
                update = p.grad.add(buf, alpha=0.95)
                split = splits.get(name.split(".")[0], HeadSplit(1, (p.shape[0],)))
                O = torch_split_ns(update, split, schedule)
                p.mul_(1 - 1e-4 * 0.1)
                start, grouped = 0, p.view(split.num_heads, split.rows_per_head, -1)
                for rows in split.block_rows:
                    scale = 0.2 * math.sqrt(max(rows, p.shape[1]))
                    grouped[:, start:start + rows].add_(
                        O.view_as(grouped)[:, start:start + rows], alpha=-1e-4 * scale)
                    start += rows
    flops = STEPS * sum(
        (3 * min(r, c) ** 2 * max(r, c) + min(r, c) ** 3) * split.num_heads
        for name, p in layer.named_parameters()
        for split in [splits.get(name.split(".")[0], HeadSplit(1, (p.shape[0],)))]
        for r, c in [(rows, p.shape[1]) for rows in split.block_rows])
    floor_s = flops / _common.matmul_rate(device)
    row = {"matrices": ", ".join(f"{n.split('.')[0]} {tuple(p.shape)}"
                                 for n, p in layer.named_parameters()),
           "floor_us": floor_s * 1e6}
    for name, fn in (("MuonSplit.step", opt.step), ("torch_formula_step", torch_step)):
        try:
            seconds = _common.time_fn(fn, device=device)
        except Exception as exc:
            notes[f"step:{name}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        row[f"{name}_us"] = seconds * 1e6
        row[f"{name}/floor"] = seconds / floor_s
    if "MuonSplit.step_us" in row and "torch_formula_step_us" in row:
        row["speedup"] = row["torch_formula_step_us"] / row["MuonSplit.step_us"]
    return row


def interpreter_check() -> dict:
    """The Triton kernels (run by the interpreter) against the reference on fresh inputs."""
    from glm_kernels.testing import rel_error
    gen = torch.Generator().manual_seed(1)
    G = torch.randn(2 * 40, 72, generator=gen)
    split = HeadSplit(2, (30, 10))
    schedule = resolve_coefficients(COEFFICIENTS, STEPS)
    out = {}
    for method in ("standard", "gram"):
        restarts = _reference.gram_restarts(STEPS, 3) if method == "gram" else ()
        ref = _reference.split_orthogonalize_reference(G, 2, (30, 10), schedule, method=method,
                                                       restarts=restarts)
        with glm_kernels.force_backend("interpret"):
            got = muon_split_orthogonalize(G, split, coefficients=COEFFICIENTS, method=method,
                                           config=NSConfig(operand_dtype=torch.float32))
        out[f"{method}_rel_err_fp32"] = rel_error(got, ref)
    print("\ninterpreter check, 2 x ([30, 10] x 72), fp32 products: kernel vs reference "
          + ", ".join(f"{k} {v:.1e}" for k, v in out.items()))
    return out


def accuracy_study(seeds=(0, 1)) -> dict:
    """Why gram uses fp16 products and a restart every 3 steps (reference emulation, CPU).

    Worst ratio, over inputs, of gram's relative error to standard's (bf16 products), both
    against the exact fp64 iteration, for each schedule, step count and restart period.
    """
    from glm_kernels.testing import rel_error
    worst = {}
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        for m, n in ((48, 300), (128, 700), (256, 2048)):
            for lowest in (None, 1e-5, 1e-3, 1e-2, 1e-1):
                if lowest is None:
                    G = torch.randn(2, m, n, generator=gen, dtype=torch.float64)
                else:
                    u, _ = torch.linalg.qr(torch.randn(2, n, m, generator=gen,
                                                       dtype=torch.float64))
                    v, _ = torch.linalg.qr(torch.randn(2, m, m, generator=gen,
                                                       dtype=torch.float64))
                    s = torch.logspace(math.log10(lowest), 0, m, dtype=torch.float64)
                    G = (v * s) @ u.mT
                X = G / (torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True) + 1e-7)
                for name in ("jordan", "polar_express"):
                    for steps in (5, 8):
                        schedule = resolve_coefficients(name, steps)
                        exact = _reference.standard_iterations(X, schedule)
                        standard = rel_error(_reference.standard_iterations(
                            X.float(), schedule, torch.bfloat16), exact)
                        for every in (0, 2, 3, 4):
                            gram = rel_error(_reference.gram_iterations(
                                X.float(), schedule, _reference.gram_restarts(steps, every),
                                torch.float16), exact)
                            key = f"{name},steps={steps},restart_every={every}"
                            worst[key] = max(worst.get(key, 0.0), gram / standard)
    for key, ratio in sorted(worst.items()):
        print(f"{key:42s} worst gram(fp16) / standard(bf16) error: {ratio:.3g}")
    return worst


def run(quick: bool = False, cpu: bool = False) -> dict:
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    cases = GPU_CASES if device == "cuda" else CPU_CASES
    if quick and device == "cuda":
        cases = cases[:3]
    notes: dict = {}
    # torch.compile on CPU spends 4-8 s per shape in the C++ compiler: a quick CPU run
    # compiles the first case only.
    compiled_cases = 1 if (quick and device == "cpu") else len(cases)
    if compiled_cases < len(cases):
        notes["torch_compile"] = "quick CPU run: compiled for the first case only"
    rows = bench_ns(device, cases, notes, compiled_cases)
    backend = _dispatch.select_backend("newton_schulz", torch.empty(1, device=device))
    providers = ["standard", "gram", "torch_eager", "torch_compile", "unsplit_torch",
                 "unsplit_standard"]
    columns = ["case", "shape", "floor_us"] + [f"{p}_us" for p in providers] + \
        ["standard/floor", "gram/floor", "standard_vs_torch_eager", "gram_vs_torch_eager",
         "standard_vs_torch_compile", "gram_vs_torch_compile"]
    _common.print_table(
        f"Newton-Schulz, {STEPS} steps {COEFFICIENTS}, fp32 input, on {device} "
        f"(glm_kernels backend: {backend}; matmul rate {_common.matmul_rate(device) / 1e12:.2f} "
        f"TFLOP/s measured, {'bf16' if device == 'cuda' else 'fp32'})", rows, columns)
    by_case = {r["case"]: r for r in rows}
    ragged = None
    if "standard_us" in by_case.get("q_b ragged", {}) and "standard_us" in by_case.get(
            "q_b heads", {}):
        ragged = by_case["q_b ragged"]["standard_us"] / by_case["q_b heads"]["standard_us"]
        print(f"ragged q_b / equal-block q_b (standard): {ragged:.3f}")
    step = bench_step(device, notes)
    _common.print_table("One MuonSplit.step() over one attention layer's matrices", [step],
                        ["floor_us", "MuonSplit.step_us", "torch_formula_step_us",
                         "MuonSplit.step/floor", "speedup"])
    print(f"  matrices: {step['matrices']}")
    print(f"goals: {GOALS}")
    result = {"benchmark": "muon", "device": device, "glm_kernels_backend": backend,
              "matmul_rate_flops": _common.matmul_rate(device), "rows": rows,
              "ragged_over_equal": ragged, "step": step, "goals": GOALS, "notes": notes,
              "fallbacks": _dispatch.fallbacks_logged(), "env": _common.environment()}
    return _common.finish(result, notes, {"interpreter_check": interpreter_check})


def main():
    args = _common.bench_args(__doc__, lambda parser: parser.add_argument(
        "--accuracy", action="store_true",
        help="only the gram-vs-standard precision study (CPU, ~2 minutes)"))
    if args.accuracy:
        _common.write_json(args.json, {"accuracy": accuracy_study()})
        return
    _common.write_json(args.json, run(quick=args.quick, cpu=args.cpu))


if __name__ == "__main__":
    main()
