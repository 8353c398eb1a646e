"""IcePop from logits and from hidden states: glm_kernels vs torch vs Liger-Kernel vs floor.

Two tables, fwd+bwd time and peak memory per provider, measured in one run:

* from logits: ``icepop_loss_from_logits`` on bf16 logits [N, V] (new gradient buffer, and
  in place) vs the torch reference (eager, torch.compile) and Liger's Triton GRPO loss.
  Floor: one read of the logits and one write of the gradient, N V (2 + 2) bytes, over the
  copy bandwidth measured in the same run.
* fused linear: ``fused_linear_icepop_loss`` from hidden [N, H] and weight [V, H] vs the
  unfused path (matmul + the from-logits kernel + autograd matmuls), the torch reference and
  Liger's chunked fused-linear GRPO loss. Floor: the three GEMMs any path runs (logits,
  grad hidden, grad weight), 3 * 2 N V H FLOPs, over the bf16 matmul rate measured here.

Equal work with Liger: its GRPO loss is the clipped PPO term without IcePop's gate (its
per-token math is cheaper, if anything) on logits [B, T + 1, V] (one extra position per
sequence, skipped): we give both the same N = B T rows, per-sequence advantages, the rollout
log-probs as its old log-probs, beta = 0 and a token-mean ("dapo") reduction.

    python benchmarks/bench_logits.py            # GPU: N = 4K/16K/64K, V = 154880 and V/8
    python benchmarks/bench_logits.py --cpu      # CPU sizes, plus an interpreter check
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
from glm_kernels.loss import fused_linear_icepop_loss, icepop_loss_from_logits  # noqa: E402
from glm_kernels.loss.icepop import _reference as ref  # noqa: E402

VOCAB, HIDDEN, SEQ_LEN = 154880, 6144, 1024


def make_inputs(n_tokens, vocab, device, *, hidden=None, seed=0):
    """bf16 logits (or hidden + weight), ids, and IcePop inputs for B = N / T sequences."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t = min(SEQ_LEN, n_tokens)
    b = n_tokens // t
    dtype = torch.bfloat16
    out = {"ids": torch.randint(0, vocab, (b, t), device=device, generator=gen)}
    if hidden is None:
        out["logits"] = (torch.randn(b, t, vocab, device=device, generator=gen) * 2).to(dtype)
    else:
        out["hidden"] = torch.randn(b, t, hidden, device=device, generator=gen).to(dtype)
        out["weight"] = (torch.randn(vocab, hidden, device=device, generator=gen)
                         / hidden ** 0.5 * 2).to(dtype)
    # log-probs of uniform-ish logits are about -log V; the ratio spread pops a few tokens.
    out["rollout"] = -torch.rand(b, t, device=device, generator=gen) * 2 - math.log(vocab)
    out["adv"] = torch.randn(b, device=device, generator=gen)          # per sequence
    out["mask"] = torch.rand(b, t, device=device, generator=gen) > 0.05
    return out


# --------------------------------------------------------------------------- providers
def _from_logits_providers(device, compile_reference):
    def ours(inplace, metrics=False):
        def make(inp):
            x = inp["logits"].detach().requires_grad_(True)

            def step():
                x.grad = None
                out = icepop_loss_from_logits(x, inp["ids"], inp["rollout"], inp["adv"],
                                              inp["mask"], inplace_backward=inplace,
                                              return_metrics=metrics)
                (out[0] if metrics else out).backward()
            return step
        return make

    def reference(fn):
        def make(inp):
            x = inp["logits"].detach().requires_grad_(True)

            def step():
                x.grad = None
                fn(x, inp["ids"], inp["rollout"], inp["adv"], inp["mask"]).backward()
            return step
        return make

    providers = {"glm_kernels": ours(False), "glm_kernels_metrics": ours(False, True),
                 "glm_kernels_inplace": ours(True),
                 "torch_eager": reference(ref.icepop_loss_from_logits_reference)}
    if compile_reference:
        providers["torch_compile"] = reference(torch.compile(
            ref.icepop_loss_from_logits_reference))
    notes = {}
    liger = _liger_grpo(device)
    if isinstance(liger, str):
        notes["liger_grpo_triton"] = liger
    else:
        providers["liger_grpo_triton"] = liger
    return providers, notes


def _liger_grpo(device):
    """Liger's Triton GRPO loss (fwd kernel + recomputing bwd kernel), in place like ours."""
    if device != "cuda":
        return "not run (Liger's Triton kernels need CUDA)"
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as exc:
        return f"not installed ({type(exc).__name__})"

    def make(inp):
        b, t, v = inp["logits"].shape
        logits = torch.empty(b, t + 1, v, dtype=inp["logits"].dtype, device=device)
        logits[:, :t] = inp["logits"]
        logits[:, t] = inp["logits"][:, -1]
        x = logits.requires_grad_(True)

        def step():
            x.grad = None
            out = triton_grpo_loss(x, inp["rollout"], None, inp["ids"], inp["adv"],
                                   inp["mask"].int(), temperature=1.0, beta=0.0, eps_low=0.2,
                                   eps_high=0.28, inplace=True)
            (out[0] if isinstance(out, tuple) else out).backward()
        return step
    return make


def _fused_linear_providers(device, compile_reference):
    def ours(inp, metrics=False):
        h = inp["hidden"].detach().requires_grad_(True)
        w = inp["weight"].detach().requires_grad_(True)

        def step():
            h.grad = w.grad = None
            out = fused_linear_icepop_loss(h, w, inp["ids"], inp["rollout"], inp["adv"],
                                           inp["mask"], return_metrics=metrics)
            (out[0] if metrics else out).backward()
        return step

    def unfused(inp):                         # materialized logits, our from-logits kernel
        h = inp["hidden"].detach().requires_grad_(True)
        w = inp["weight"].detach().requires_grad_(True)

        def step():
            h.grad = w.grad = None
            icepop_loss_from_logits(h @ w.t(), inp["ids"], inp["rollout"], inp["adv"],
                                    inp["mask"], inplace_backward=True).backward()
        return step

    def reference(fn):
        def make(inp):
            h = inp["hidden"].detach().requires_grad_(True)
            w = inp["weight"].detach().requires_grad_(True)

            def step():
                h.grad = w.grad = None
                fn(h, w, inp["ids"], inp["rollout"], inp["adv"], inp["mask"]).backward()
            return step
        return make

    providers = {"glm_kernels": ours,
                 "glm_kernels_metrics": lambda inp: ours(inp, metrics=True),
                 "unfused_glm_kernels": unfused,
                 "torch_eager": reference(ref.fused_linear_icepop_loss_reference)}
    if compile_reference:
        providers["torch_compile"] = reference(torch.compile(
            ref.fused_linear_icepop_loss_reference))
    notes = {}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as exc:
        notes["liger_fused_linear_grpo"] = f"not installed ({type(exc).__name__})"
    else:
        liger = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo",
                                         epsilon_low=0.2, epsilon_high=0.28)

        def make_liger(inp):
            h = inp["hidden"].detach().requires_grad_(True)
            w = inp["weight"].detach().requires_grad_(True)

            def step():
                h.grad = w.grad = None
                out = liger(h, w, inp["ids"], inp["mask"].int(), inp["adv"],
                            old_per_token_logps=inp["rollout"])
                (out[0] if isinstance(out, tuple) else out).backward()
            return step
        providers["liger_fused_linear_grpo"] = make_liger
    return providers, notes


# --------------------------------------------------------------------------- measurement
def _measure(make, inputs, device):
    """(median seconds, peak bytes above the inputs) of one provider's fwd+bwd step."""
    step = make(inputs)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        # No allocator statistics on CPU; tests/loss/test_logits_fused_linear.py checks there
        # that the fused-linear path allocates nothing of [tokens, V].
        peak = None
    return _common.time_fn(step, device=device), peak


def _table(title, section, sizes, providers, notes, floor_fn, device, make):
    rows = []
    for n, v in sizes:
        inputs = make(n, v)
        floor_s = floor_fn(n, v)
        row = {"tokens": n, "vocab": v, "floor_ms": floor_s * 1e3}
        for name, provider in providers.items():
            try:
                seconds, peak = _measure(provider, inputs, device)
            except torch.cuda.OutOfMemoryError:
                notes[f"{name}@{n}x{v}"] = "out of memory"
                continue
            except Exception as exc:      # a provider that fails is reported, not hidden
                notes[f"{name}@{n}x{v}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}/floor"] = seconds / floor_s
            if peak is not None:
                row[f"{name}_peak_GiB"] = peak / 2 ** 30
        for other in providers:
            if other != "glm_kernels" and f"{other}_ms" in row and "glm_kernels_ms" in row:
                row[f"speedup_vs_{other}"] = row[f"{other}_ms"] / row["glm_kernels_ms"]
        rows.append(row)
        del inputs
    columns = ["tokens", "vocab", "floor_ms"] + [
        c for p in providers for c in (f"{p}_ms", f"{p}/floor", f"{p}_peak_GiB")]
    columns += [f"speedup_vs_{p}" for p in providers if p != "glm_kernels"]
    _common.print_table(title, rows, [c for c in columns if any(c in r for r in rows)])
    return {"section": section, "rows": rows}


def run(quick: bool = False, cpu: bool = False) -> dict:
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    if device == "cuda":
        tokens = [4096] if quick else [4096, 16384, 65536]
        vocabs, hidden = [VOCAB, VOCAB // 8], HIDDEN
    else:
        tokens, vocabs, hidden = [128], [2048, 512], 128
    bandwidth = _common.copy_bandwidth(device)
    rate = _common.matmul_rate(device)
    backend = _dispatch.select_backend("icepop_loss_from_logits",
                                       torch.empty(1, device=device))
    notes = {}
    # torch.compile recompiles per shape (tens of seconds each): the smallest sizes only (one
    # vocab on CPU, where compiling is slowest).
    sizes = [(n, v) for n in tokens for v in vocabs]
    n_compiled = 1 if device == "cpu" else len(vocabs)
    small, rest = sizes[:n_compiled], sizes[n_compiled:]
    tables = []
    for section, providers_fn, floor_fn, make in (
            ("from_logits", _from_logits_providers,
             lambda n, v: n * v * 4 / bandwidth,
             lambda n, v: make_inputs(n, v, device)),
            ("fused_linear", _fused_linear_providers,
             lambda n, v: 3 * 2 * n * v * hidden / rate,
             lambda n, v: make_inputs(n, v, device, hidden=hidden))):
        for sizes, with_compile in ((small, True), (rest, False)):
            if not sizes:
                continue
            providers, provider_notes = providers_fn(device, with_compile)
            notes.update(provider_notes)
            tables.append(_table(
                f"{section} fwd+bwd on {device} (glm_kernels backend: {backend}; copy "
                f"{bandwidth / 1e9:.1f} GB/s, matmul {rate / 1e9:.0f} GFLOP/s measured; "
                f"H = {hidden})", section, sizes, providers, notes, floor_fn, device, make))
    if device == "cuda":
        tables.append(_tuning_sweeps(tokens[0], vocabs, hidden, bandwidth, rate))
    result = {"benchmark": "logits", "device": device, "glm_kernels_backend": backend,
              "copy_bandwidth_Bps": bandwidth, "matmul_flops": rate, "hidden": hidden,
              "tables": tables, "notes": notes, "fallbacks": _dispatch.fallbacks_logged(),
              "env": _common.environment()}
    return _common.finish(result, notes, {
        "interpreter_check": interpreter_check,
        "interpreter_metrics_side_by_side": interpreter_metrics_side_by_side})


def _tuning_sweeps(n_tokens, vocabs, hidden, bandwidth, rate) -> dict:
    """GPU only: the choices made without a GPU, measured. The fused pass alone (forward with
    the gradient written in place) for 1, 2, 4 persistent programs per SM (long rows are swept
    twice; fewer rows in flight = more L2 hits on the second sweep); fused-linear fwd+bwd for
    several chunk sizes (time and peak memory)."""
    from glm_kernels.loss._common.launch import LogitsLaunchConfig
    from glm_kernels.loss.icepop.from_logits import (flat_token_inputs, icepop_rows_into,
                                                     token_scales)
    rows = []
    for v in vocabs:
        inp = make_inputs(n_tokens, v, "cuda")
        logits = inp["logits"].reshape(n_tokens, v)
        shape = inp["ids"].shape
        rollout, adv, mask, _ = flat_token_inputs(shape, inp["rollout"], inp["adv"],
                                                  inp["mask"], None)
        scale = token_scales(inp["mask"], shape, "token_mean", logits.device)
        ids = inp["ids"].reshape(-1)
        for per_sm in (1, 2, 4):
            cfg = LogitsLaunchConfig(programs_per_sm=per_sm)
            seconds = _common.time_fn(lambda: icepop_rows_into(
                logits, logits, ids, rollout, None, adv, mask, scale, inv_temp=1.0,
                gate_low=0.5, gate_high=2.0, eps_low=0.2, eps_high=0.28, config=cfg),
                device="cuda")
            rows.append({"what": f"fused pass, {per_sm} programs/SM", "tokens": n_tokens,
                         "vocab": v, "ms": seconds * 1e3,
                         "time/floor": seconds / (n_tokens * v * 4 / bandwidth)})
        del inp, logits
        inp = make_inputs(n_tokens, v, "cuda", hidden=hidden)
        for chunk in (1024, 2048, 4096):
            def make(inputs, chunk=chunk):
                h = inputs["hidden"].detach().requires_grad_(True)
                w = inputs["weight"].detach().requires_grad_(True)

                def step():
                    h.grad = w.grad = None
                    fused_linear_icepop_loss(h, w, inputs["ids"], inputs["rollout"],
                                             inputs["adv"], inputs["mask"],
                                             chunk_size=chunk).backward()
                return step
            seconds, peak = _measure(make, inp, "cuda")
            rows.append({"what": f"fused linear, chunk {chunk}", "tokens": n_tokens,
                         "vocab": v, "ms": seconds * 1e3, "peak_GiB": peak / 2 ** 30,
                         "time/floor": seconds / (6 * n_tokens * v * hidden / rate)})
        del inp
        torch.cuda.empty_cache()
    _common.print_table("tuning sweeps (GPU)", rows,
                        ["what", "tokens", "vocab", "ms", "time/floor", "peak_GiB"])
    return {"section": "tuning", "rows": rows}


def interpreter_metrics_side_by_side(n_tokens=64, vocab=700, hidden=64,
                                     tiled_vocab=300) -> dict:
    """return_metrics False vs True, fwd+bwd, in Triton's interpreter on the CPU (the fused
    from-logits pass, on rows streamed (vocab) and held in three register tiles (tiled_vocab,
    under the interpreter's launch config); the fused-linear loss, whose matmuls run in
    torch). CPU interpreter figures: they say nothing about GPU time (not measured on GPU)."""
    rows = []
    from_logits = _from_logits_providers("cpu", False)[0]
    with glm_kernels.force_backend("interpret"):
        for section, providers, inp, cols in (
                ("from_logits, streamed", from_logits,
                 make_inputs(n_tokens, vocab, "cpu", seed=3), vocab),
                ("from_logits, three tiles", from_logits,
                 make_inputs(n_tokens, tiled_vocab, "cpu", seed=3), tiled_vocab),
                ("fused_linear", _fused_linear_providers("cpu", False)[0],
                 make_inputs(n_tokens, vocab, "cpu", seed=3, hidden=hidden), vocab)):
            row = {"op": f"{section} ({n_tokens} x {cols})"}
            for name, key in (("glm_kernels", "metrics_off_ms"),
                              ("glm_kernels_metrics", "metrics_on_ms")):
                row[key] = 1e3 * _common.time_fn(providers[name](inp), device="cpu", warmup=1,
                                                 repeats=5)
            row["on/off"] = row["metrics_on_ms"] / row["metrics_off_ms"]
            rows.append(row)
    _common.print_table("return_metrics off vs on -- CPU, Triton interpreter (not GPU timing)",
                        rows, ["op", "metrics_off_ms", "metrics_on_ms", "on/off"])
    return {"label": "CPU Triton interpreter, not GPU timing", "rows": rows}


def interpreter_check(n_tokens=64, vocab=700) -> dict:
    """The fused from-logits kernel (run by the interpreter) against the reference on fresh
    inputs."""
    inp = make_inputs(n_tokens, vocab, "cpu", seed=1)
    args = (inp["ids"], inp["rollout"], inp["adv"], inp["mask"])
    return _common.loss_grad_check(
        f"{n_tokens} x {vocab} logits",
        lambda x: icepop_loss_from_logits(x, *args),
        lambda x: ref.icepop_loss_from_logits_reference(x, *args), inp["logits"].float())


if __name__ == "__main__":
    _common.main(__doc__, run)
