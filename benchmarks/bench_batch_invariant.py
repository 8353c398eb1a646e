"""What glm_kernels.batch_invariant() costs: the same op with the switch off and on, one run.

selective_logprobs (with entropy) and fused_linear_icepop_loss (forward + backward), at
shapes that fit the device: on the GPU the Triton kernels (the log-prob kernels are already
row-invariant, so the switch changes only the fused-linear GEMMs: fixed 64-row tiles), on the
CPU the torch backend (fixed-order tree reductions and the tiled GEMMs). Columns: the time off
and on, their ratio, and the floor (bytes / copy bandwidth for log-probs, FLOPs / matmul rate
for the fused-linear loss). ``bitwise`` says whether a row computed alone equals the same row
inside the batch, off and on (the switch's promise, checked in the same run).

Whole models (CPU): a forward (8 left-padded sequences of 16-32 tokens) and a decode (8
prompts, 8 new tokens through ``generate`` and its KV cache) of each tiny random transformers
model (``glm_kernels.testing.tiny_causal_lm``: Llama, Qwen3, Qwen3-MoE, GLM-5), with the
switch off and on side by side, and under a dispatch mode that passes every op through
unchanged (``passthrough``: the cost of intercepting each aten op in Python, the floor of the
override's design); ``bitwise`` is ``assert_batch_invariant`` (rollout log-probs vs full
forwards alone, batched, shuffled) in the same mode. GPU: not measured on GPU.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import _common
import glm_kernels
from glm_kernels.loss import fused_linear_icepop_loss, selective_logprobs


def _logprob_case(n, v, dtype, device):
    logits = torch.randn(n, v, device=device, dtype=dtype) * 3
    ids = torch.randint(0, v, (n,), device=device)
    run = lambda x=logits, i=ids: selective_logprobs(x, i, return_entropy=True)  # noqa: E731
    floor_s = logits.numel() * logits.element_size() / _common.copy_bandwidth(device)
    return run, floor_s, lambda: run(logits[:1], ids[:1])[0], lambda: run()[0][:1]


def _fused_linear_case(n, h, v, dtype, device):
    hidden = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h, device=device, dtype=dtype) / h ** 0.5).requires_grad_(True)
    ids = torch.randint(0, v, (n,), device=device)
    rollout = -torch.rand(n, device=device) * 3
    adv = torch.randn(n, device=device)

    def run(rows=n):
        loss = fused_linear_icepop_loss(hidden[:rows], weight, ids[:rows], rollout[:rows],
                                        adv[:rows], reduction="sum")
        loss.backward()
        return hidden.grad

    def row0(rows):
        hidden.grad = None
        return run(rows)[:1].clone()

    floor_s = 3 * 2 * n * h * v / _common.matmul_rate(device)      # three GEMMs
    return run, floor_s, lambda: row0(1), lambda: row0(n)


def _measure(label, case, device, quick):
    run, floor_s, alone, in_batch = case
    row = {"case": label}
    for mode in ("off", "on"):
        with glm_kernels.batch_invariant(mode == "on"):
            row[f"{mode}_ms"] = _common.time_fn(run, device=device,
                                                repeats=3 if quick else 10) * 1e3
            row[f"bitwise_{mode}"] = bool(torch.equal(alone(), in_batch()))
    row["on_vs_off"] = row["on_ms"] / row["off_ms"]
    row["floor_ms"] = floor_s * 1e3
    row["on_vs_floor"] = row["on_ms"] / row["floor_ms"]
    return row


def _model_rows(quick: bool) -> list:
    """Forward and decode of each tiny model, off and on, on the CPU (fp32, one thread)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("note: transformers is not installed: whole-model rows skipped")
        return []
    from glm_kernels.testing import TINY_MODEL_TYPES
    g = torch.Generator().manual_seed(0)
    lengths = [16 + (4 * i) % 17 for i in range(8)]
    rows_in = [torch.randint(1, 96, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(8, width, dtype=torch.long)
    mask = torch.zeros(8, width, dtype=torch.long)
    for i, r in enumerate(rows_in):
        ids[i, width - r.numel():], mask[i, width - r.numel():] = r, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    prompts = [r[:4 + i % 5] for i, r in enumerate(rows_in)]
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model_type in TINY_MODEL_TYPES:
            rows += _time_model(model_type, ids, mask, positions, prompts, quick)
    finally:
        torch.set_num_threads(threads)
    return rows


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that runs every op unchanged: what intercepting each aten op in Python
    costs before the override does any work (the floor of ``batch_invariant()``'s design)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _time_model(model_type, ids, mask, positions, prompts, quick) -> list:
    """One model's forward and decode rows: off and on side by side, and the bitwise check."""
    from glm_kernels.testing import assert_batch_invariant, tiny_causal_lm
    rows = []
    model = tiny_causal_lm(model_type)

    def forward(m=model):
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=mask, position_ids=positions,
                     use_cache=False).logits

    def decode(m=model):
        torch.manual_seed(0)
        p_ids = torch.zeros(8, 8, dtype=torch.long)
        p_mask = torch.zeros(8, 8, dtype=torch.long)
        for i, p in enumerate(prompts):
            p_ids[i, 8 - p.numel():], p_mask[i, 8 - p.numel():] = p, 1
        with torch.no_grad():
            return m.generate(p_ids, attention_mask=p_mask, do_sample=True,
                              max_new_tokens=8, min_new_tokens=8, pad_token_id=0)

    for label, fn in (("forward 8x<=32", forward), ("decode 8x8 new", decode)):
        row = {"case": f"{model_type} {label} fp32 cpu"}
        # The mechanism's own floor: a dispatch mode that only passes every op through.
        with _PassThrough():
            row["passthrough_ms"] = _common.time_fn(fn, device="cpu", warmup=1,
                                                    repeats=3 if quick else 7,
                                                    process_clock=True) * 1e3
        for mode in ("off", "on"):
            with glm_kernels.batch_invariant(mode == "on"):
                # Process CPU time on one thread: the machine is shared, and the wall
                # clock would also count the time spent waiting for a core.
                row[f"{mode}_ms"] = _common.time_fn(fn, device="cpu", warmup=1,
                                                    repeats=3 if quick else 7,
                                                    process_clock=True) * 1e3
                if label.startswith("decode"):
                    try:
                        assert_batch_invariant(model, prompts[:3], max_new_tokens=3)
                        row[f"bitwise_{mode}"] = True
                    except AssertionError:
                        row[f"bitwise_{mode}"] = False
        row["on_vs_off"] = row["on_ms"] / row["off_ms"]
        row["passthrough_vs_off"] = row["passthrough_ms"] / row["off_ms"]
        rows.append(row)
    return rows


def run(quick: bool = False, cpu: bool = False) -> dict:
    device = "cpu" if cpu else _common.default_device()
    on_gpu = device.startswith("cuda")
    torch.manual_seed(0)
    if on_gpu:
        logprob_shapes = [(4096, 154880 // 8, torch.bfloat16), (4096, 154880, torch.bfloat16)]
        linear_shapes = [(4096, 6144, 154880 // 8, torch.bfloat16)]
    else:
        logprob_shapes = [(512, 32000, torch.float32)] if quick else [
            (512, 32000, torch.float32), (2048, 19360, torch.float32)]
        linear_shapes = [(256, 512, 8192, torch.float32)]
    rows = [_measure(f"logprobs N={n} V={v} {str(dt)[6:]}", _logprob_case(n, v, dt, device),
                     device, quick) for n, v, dt in logprob_shapes]
    rows += [_measure(f"fused_linear N={n} H={h} V={v} {str(dt)[6:]}",
                      _fused_linear_case(n, h, v, dt, device), device, quick)
             for n, h, v, dt in linear_shapes]
    title = f"batch_invariant() off vs on, {device}" + ("" if on_gpu else " (torch backend)")
    _common.print_table(title, rows, ["case", "off_ms", "on_ms", "on_vs_off", "floor_ms",
                                      "on_vs_floor", "bitwise_off", "bitwise_on"])
    model_rows = _model_rows(quick)
    _common.print_table("whole tiny models, batch_invariant() off vs on (CPU, torch backend)",
                        model_rows, ["case", "off_ms", "on_ms", "on_vs_off", "passthrough_ms",
                                     "passthrough_vs_off", "bitwise_off", "bitwise_on"])
    result = {"device": device, "environment": _common.environment(), "rows": rows,
              "model_rows": model_rows}
    notes = {"gpu": "measured" if on_gpu else "not measured on GPU",
             "models": "CPU only; whole-model rows not measured on GPU"}
    return _common.finish(result, notes, {})


if __name__ == "__main__":
    _common.main(__doc__, run)
