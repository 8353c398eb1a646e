"""Log-probs + entropy from hidden states: fused_linear_logprobs vs the trainers' own paths.

One fwd+bwd step, loss = sum(g * logprob) + sum(h * entropy) (an entropy bonus and a policy
term), from hidden [N, H] and lm_head weight [V, H], temperature 0.7, side by side in one run:

* ``glm_kernels``: ``fused_linear_logprobs(..., return_entropy=True)``, chunked over tokens.
* ``verl``: what verl 0.9.1's actor runs: logits = hidden @ weight.T materialised, divided by
  T, ``verl.utils.torch_functional.logprobs_from_logits`` and ``entropy_from_logits``.
* ``glm_kernels_from_logits``: the same materialised logits into ``selective_logprobs``.
* ``trl_fused_lm_head``: TRL 1.16's ``ChunkedLogProbFunction`` (its GRPO trainer's LM head),
  vocab tiles of 4096 columns.

Time: median of repeats (on the CPU also the process time per step). Peak memory: the bytes
held by live tensors allocated during the step, above the inputs (CUDA: the allocator's peak;
CPU: the peak of live aten outputs, the tracker tests/loss/test_logits_fused_linear.py uses).
Ratios: each provider / verl's.

    python benchmarks/bench_entropy.py --cpu     # N = 512, V = 4096, H = 64, fp32, C = 64
    python benchmarks/bench_entropy.py           # GPU: N = 4K / 16K, V = 154880, H = 6144,
                                                 # bf16 (written; not measured on GPU)
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from glm_kernels import _dispatch, fused_linear_logprobs, selective_logprobs  # noqa: E402

TEMPERATURE = 0.7
CPU_REPEATS = 3


def make_inputs(n_tokens, vocab, hidden, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device=device, generator=gen)  # noqa: E731
    return {"hidden": rand(n_tokens, hidden).to(dtype),
            "weight": (rand(vocab, hidden) / hidden ** 0.5 * 2).to(dtype),
            "ids": torch.randint(0, vocab, (n_tokens,), device=device, generator=gen),
            "grad_lp": rand(n_tokens), "grad_entropy": rand(n_tokens)}


def providers(chunk_size=None):
    """name -> f(hidden, weight, ids) -> (logprobs, entropy), each differentiable."""
    out = {"glm_kernels": lambda h, w, ids: fused_linear_logprobs(
        h, w, ids, temperature=TEMPERATURE, return_entropy=True, chunk_size=chunk_size)}
    try:
        from verl.utils import torch_functional as verl_f

        def verl(h, w, ids):
            logits = (h @ w.t()) / TEMPERATURE
            return verl_f.logprobs_from_logits(logits, ids), verl_f.entropy_from_logits(logits)
        out["verl"] = verl
    except ImportError as exc:
        print(f"note: verl not importable ({exc}); no verl column")
    out["glm_kernels_from_logits"] = lambda h, w, ids: selective_logprobs(
        h @ w.t(), ids, temperature=TEMPERATURE, return_entropy=True)
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def trl(h, w, ids):
            lp, entropy, *_ = ChunkedLogProbFunction.apply(h, w, None, ids, TEMPERATURE, 4096,
                                                            None, 1.0, ("entropy",))
            return lp, entropy
        out["trl_fused_lm_head"] = trl
    except ImportError as exc:
        print(f"note: trl.kernels.chunked_logprob not importable ({exc}); no TRL column")
    return out


def _step(fn, inp):
    def step():
        h = inp["hidden"].detach().requires_grad_(True)
        w = inp["weight"].detach().requires_grad_(True)
        lp, entropy = fn(h, w, inp["ids"])
        ((lp * inp["grad_lp"]).sum() + (entropy * inp["grad_entropy"]).sum()).backward()
    return step


def measure(step, device):
    """(median seconds, peak bytes above the inputs, CPU seconds per step or None) of one
    fwd+bwd step. On the CPU the process time is reported beside the wall time: on a shared
    machine it is the steadier of the two."""
    if device == "cuda":
        from bench_logits import _measure            # the allocator's peak, then the timing
        return (*_measure(lambda _: step, None, device), None)
    from tests.loss.test_logits_fused_linear import _PeakLiveBytes
    tracker = _PeakLiveBytes()
    with tracker:                                    # also the warm-up
        step()
    start = time.process_time()
    seconds = _common.time_fn(step, device=device, warmup=0, repeats=CPU_REPEATS)
    return seconds, tracker.peak, (time.process_time() - start) / CPU_REPEATS


def run(quick: bool = False, cpu: bool = False) -> dict:
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    if device == "cuda":
        sizes = [4096] if quick else [4096, 16384]
        vocab, hidden, dtype = 154880, 6144, torch.bfloat16
        chunk_size = None                     # the default 512 MiB budget: 1664 tokens
    else:
        # A chunk of 1/8 of the tokens: the default budget would take them all at once here.
        sizes, vocab, hidden, dtype, chunk_size = [512], 4096, 64, torch.float32, 64
    backend = _dispatch.select_backend("selective_logprobs", torch.empty(1, device=device))
    rate = _common.matmul_rate(device)
    notes, rows = {}, []
    for n in sizes:
        inp = make_inputs(n, vocab, hidden, dtype, device)
        floor_s = 3 * 2 * n * vocab * hidden / rate          # the three GEMMs any path runs
        row = {"tokens": n, "vocab": vocab, "hidden": hidden, "floor_ms": floor_s * 1e3}
        for name, fn in providers(chunk_size).items():
            step = _step(fn, inp)
            try:
                seconds, peak, cpu_seconds = measure(step, device)
            except Exception as exc:           # a provider that fails is reported, not hidden
                notes[f"{name}@{n}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            row[f"{name}_ms"], row[f"{name}_peak_MiB"] = seconds * 1e3, peak / 2 ** 20
            if cpu_seconds is not None:
                row[f"{name}_cpu_ms"] = cpu_seconds * 1e3
        for name in providers():
            if f"{name}_ms" in row and "verl_ms" in row:
                row[f"{name}_time/verl"] = row[f"{name}_ms"] / row["verl_ms"]
                row[f"{name}_peak/verl"] = row[f"{name}_peak_MiB"] / row["verl_peak_MiB"]
                if "verl_cpu_ms" in row:
                    row[f"{name}_cpu/verl"] = row[f"{name}_cpu_ms"] / row["verl_cpu_ms"]
        rows.append(row)
        del inp
    names = list(providers())
    _common.print_table(
        f"log-probs + entropy fwd+bwd from hidden states on {device} ({dtype}, T = "
        f"{TEMPERATURE}; glm_kernels backend: {backend}, chunk_size "
        f"{chunk_size or 'from budget'}; matmul {rate / 1e9:.0f} GFLOP/s measured)", rows,
        ["tokens", "vocab", "hidden", "floor_ms"]
        + [c for p in names for c in (f"{p}_ms", f"{p}_cpu_ms") if any(c in r for r in rows)])
    _common.print_table("side by side (provider / verl)", rows,
                        ["tokens"] + [c for p in names for c in (
                            f"{p}_peak_MiB", f"{p}_time/verl", f"{p}_cpu/verl", f"{p}_peak/verl")
                            if any(c in r for r in rows)])
    result = {"benchmark": "entropy", "device": device, "glm_kernels_backend": backend,
              "matmul_flops": rate, "chunk_size": chunk_size, "rows": rows, "notes": notes,
              "fallbacks": _dispatch.fallbacks_logged(), "env": _common.environment()}
    return _common.finish(result, notes, {})


if __name__ == "__main__":
    _common.main(__doc__, run)
