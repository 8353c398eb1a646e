"""Deterministic top-k and noaux_tc routing: glm_kernels vs torch.topk vs stable sort vs floor.

Tables (GPU sizes from issue 6; CPU runs use small sizes and the torch reference path):
  moe_topk   16K / 64K tokens x 256 experts, k = 8, fp32.
  moe_route  the same tokens, sigmoid + bias, 8 groups / top-4 groups and 1 group, k = 8,
             scaling 2.5; peers: the HF DeepseekV3TopkRouter torch sequence (torch.topk,
             non-deterministic ties) eager and torch.compile'd, and the readable reference.
  dsa_topk   64 and 2048 rows x 32K / 128K / 200K keys, k = 2048, fp32, without and with
             ``lengths`` (uniform in [k, n]; the torch peers first mask the tail with -inf).
Providers: glm_kernels, torch.topk (the non-deterministic baseline) and
torch.sort(stable=True) + slice (the deterministic baseline). Every glm_kernels result is
checked bit-for-bit against the stable sort in the same run (column ``exact``).
Floor: the bytes the op must move at least -- read the input once, write values and int64
indices (routing: fp32 weights and int64 ids) -- over the copy bandwidth measured in the same
run. Timings: triton.testing.do_bench medians (L2 flushed) on GPU, perf_counter medians on CPU.

    python benchmarks/bench_topk.py [--quick] [--cpu] [--json out.json]
"""
from __future__ import annotations

import os
import sys

if "--cpu" in sys.argv:                      # the interpreter check needs this before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import glm_kernels  # noqa: E402
from glm_kernels import _dispatch  # noqa: E402
from glm_kernels.topk import _reference, moe_route, topk  # noqa: E402

GOALS = ("never slower than torch.topk; >= 2x faster than torch.topk on the DSA shapes; "
         ">= 5x faster than torch.sort(stable=True) everywhere")


def _scores(rows, n, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, n, device=device, generator=gen)


def _sort_prefix(x, k):
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def _masked(x, lengths):
    positions = torch.arange(x.shape[-1], device=x.device)
    return x.masked_fill(positions >= lengths[:, None], float("-inf"))


def _exact(got, want):
    same_values = torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
    return bool(same_values and torch.equal(got[1], want[1]))


def _time(fn, device, notes, label):
    try:
        return _common.time_fn(fn, device=device)
    except Exception as exc:      # a provider that fails is reported, not hidden
        notes[label] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return None


def _ratios(row, floor_s):
    glm = row.get("glm_kernels_us")
    for name in ("glm_kernels", "torch_topk", "torch_sort_stable"):
        if row.get(f"{name}_us") is not None:
            row[f"{name}/floor"] = row[f"{name}_us"] * 1e-6 / floor_s
    if glm:
        for name, key in (("torch_topk", "vs_topk"), ("torch_sort_stable", "vs_sort")):
            if row.get(f"{name}_us"):
                row[key] = row[f"{name}_us"] / glm


def bench_topk_rows(rows, n, k, device, bandwidth, notes, with_lengths=False):
    x = _scores(rows, n, device)
    lengths = None
    if with_lengths:
        gen = torch.Generator(device=device).manual_seed(1)
        lengths = torch.randint(k, n + 1, (rows,), device=device, generator=gen)
    floor_s = (x.numel() * 4 + rows * k * (4 + 8)) / bandwidth
    row = {"rows": rows, "n": n, "k": k, "lengths": with_lengths, "floor_us": floor_s * 1e6}
    if lengths is None:
        providers = {"glm_kernels": lambda: topk(x, k),
                     "torch_topk": lambda: torch.topk(x, k),
                     "torch_sort_stable": lambda: _sort_prefix(x, k)}
        want = _sort_prefix(x, k)
    else:
        providers = {"glm_kernels": lambda: topk(x, k, lengths=lengths),
                     "torch_topk": lambda: torch.topk(_masked(x, lengths), k),
                     "torch_sort_stable": lambda: _sort_prefix(_masked(x, lengths), k)}
        want = _reference.topk_reference(x, k, lengths=lengths)
    row["exact"] = _exact(topk(x, k, lengths=lengths), want)
    del want
    for name, fn in providers.items():
        seconds = _time(fn, device, notes, f"{name}@{rows}x{n}")
        row[f"{name}_us"] = None if seconds is None else seconds * 1e6
    _ratios(row, floor_s)
    return row


def _hf_route(logits, bias, k, n_group, topk_group, scaling):
    """HF DeepseekV3TopkRouter's torch ops (torch.topk: ties not deterministic)."""
    scores = logits.sigmoid()
    choice = scores + bias
    n_experts = logits.shape[-1]
    if n_group > 1:
        size = n_experts // n_group
        group_scores = choice.view(-1, n_group, size).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, n_group, size).reshape(-1, n_experts)
        choice = choice.masked_fill(~mask.bool(), 0.0)
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    return weights / (weights.sum(-1, keepdim=True) + 1e-20) * scaling, ids


def bench_route(tokens, n_group, topk_group, device, bandwidth, notes, compiled_cache):
    k, n_experts, scaling = 8, 256, 2.5
    logits = _scores(tokens, n_experts, device, seed=2)
    bias = _scores(1, n_experts, device, seed=3)[0] * 0.1
    floor_s = (logits.numel() * 4 + tokens * k * (4 + 8)) / bandwidth
    row = {"tokens": tokens, "n_group": n_group, "topk_group": topk_group,
           "floor_us": floor_s * 1e6}
    kwargs = dict(bias=bias, n_group=n_group, topk_group=topk_group, scaling_factor=scaling)
    got = moe_route(logits, k, **kwargs)
    want = _reference.moe_route_reference(logits, k, **kwargs)
    row["ids_equal_reference"] = bool(torch.equal(got.ids, want[1]))
    key = (n_group, topk_group)
    if key not in compiled_cache:
        compiled_cache[key] = torch.compile(_hf_route)
    providers = {
        "glm_kernels": lambda: moe_route(logits, k, **kwargs),
        "torch_hf_eager": lambda: _hf_route(logits, bias, k, n_group, topk_group, scaling),
        "torch_hf_compile": lambda: compiled_cache[key](logits, bias, k, n_group, topk_group,
                                                        scaling),
        "reference_eager": lambda: _reference.moe_route_reference(logits, k, **kwargs)}
    for name, fn in providers.items():
        seconds = _time(fn, device, notes, f"{name}@route{tokens}/{n_group}")
        row[f"{name}_us"] = None if seconds is None else seconds * 1e6
        if seconds is not None:
            row[f"{name}/floor"] = seconds / floor_s
    glm = row.get("glm_kernels_us")
    for name in ("torch_hf_eager", "torch_hf_compile", "reference_eager"):
        if glm and row.get(f"{name}_us"):
            row[f"vs_{name}"] = row[f"{name}_us"] / glm
    return row


def interpreter_check() -> dict:
    """The Triton kernels (run by the interpreter) against the stable sort on tie-heavy rows."""
    gen = torch.Generator().manual_seed(5)
    pool = torch.tensor([float("nan"), float("inf"), -0.0, 0.0, 1.0, -2.0])
    x = pool[torch.randint(0, 6, (3, 5000), generator=gen)]
    x[1] = torch.randn(5000, generator=gen)
    lengths = torch.tensor([5000, 4000, 100])
    logits = torch.randn(64, 256, generator=gen)
    with glm_kernels.force_backend("interpret"):
        got = topk(x, 512)
        got_len = topk(x, 512, lengths=lengths, sorted=False)
        route = moe_route(logits, 8, n_group=8, topk_group=4)
    want_route = _reference.moe_route_reference(logits, 8, n_group=8, topk_group=4)
    result = {"topk_exact": _exact(got, _sort_prefix(x, 512)),
              "topk_lengths_exact": _exact(got_len, _reference.topk_reference(
                  x, 512, sorted=False, lengths=lengths)),
              "moe_route_ids_exact": bool(torch.equal(route.ids, want_route[1])),
              "moe_route_weights_max_abs_err": (route.weights - want_route[0]).abs().max().item()}
    print(f"\ninterpreter check (3 x 5000, k = 512, ties/NaN/+-0): {result}")
    return result


def run(quick: bool = False, cpu: bool = False) -> dict:
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    on_gpu = device == "cuda"
    bandwidth = _common.copy_bandwidth(device)
    notes = {}
    if on_gpu and not quick:
        moe_tokens, dsa_rows, dsa_n = (16384, 65536), (64, 2048), (32768, 131072, 200_000)
    elif on_gpu:
        moe_tokens, dsa_rows, dsa_n = (16384,), (64, 2048), (131072,)
    else:
        moe_tokens, dsa_rows, dsa_n = (1024,), (4,), (32768,)
    moe_rows = [bench_topk_rows(t, 256, 8, device, bandwidth, notes) for t in moe_tokens]
    dsa_rows_out = [bench_topk_rows(r, n, 2048, device, bandwidth, notes, with_lengths=lengths)
                    for r in dsa_rows for n in dsa_n for lengths in (False, True)]
    compiled = {}
    route_rows = [bench_route(t, g, tg, device, bandwidth, notes, compiled)
                  for t in moe_tokens for g, tg in ((8, 4), (1, 1))]
    backend = _dispatch.select_backend("topk", torch.empty(1, device=device))
    title = f"on {device} (glm_kernels backend: {backend}; copy bandwidth " \
            f"{bandwidth / 1e9:.1f} GB/s measured)"
    columns = ["floor_us", "glm_kernels_us", "torch_topk_us", "torch_sort_stable_us",
               "glm_kernels/floor", "vs_topk", "vs_sort", "exact"]
    _common.print_table(f"MoE top-k (256 experts, k = 8, fp32) {title}", moe_rows,
                        ["rows", "n"] + columns)
    _common.print_table(f"DSA top-k (k = 2048, fp32) {title}", dsa_rows_out,
                        ["rows", "n", "lengths"] + columns)
    _common.print_table(f"noaux_tc routing (256 experts, k = 8) {title}", route_rows,
                        ["tokens", "n_group", "floor_us", "glm_kernels_us", "torch_hf_eager_us",
                         "torch_hf_compile_us", "reference_eager_us", "glm_kernels/floor",
                         "vs_torch_hf_eager", "vs_torch_hf_compile", "ids_equal_reference"])
    print(f"goals: {GOALS}")
    result = {"benchmark": "topk", "device": device, "glm_kernels_backend": backend,
              "copy_bandwidth_Bps": bandwidth, "goals": GOALS, "moe_topk": moe_rows,
              "dsa_topk": dsa_rows_out, "moe_route": route_rows, "notes": notes,
              "fallbacks": _dispatch.fallbacks_logged(), "env": _common.environment()}
    return _common.finish(result, notes, {"interpreter_check": interpreter_check})


if __name__ == "__main__":
    _common.main(__doc__, run)
