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
model (``glm_kernels.testing.tiny_causal_lm``: Llama, Qwen3, Qwen3-MoE, GLM-5), and without
``--quick`` of Llama (4 layers, sdpa) and GLM-5 (2 layers, eager) at hidden 512 (forward 4
sequences of 56-128 tokens, decode 4 prompts x 32 new tokens), with the switch off and on
side by side, beside the override's kernels registered but passing every call through
(``floor``: what reaching the covered ops costs, the floor of the override's design) and a
dispatch mode that passes every op through (``mode_floor``: what sending every aten op through
Python costs, the design before); ``bitwise`` is ``assert_batch_invariant`` (rollout log-probs
vs full forwards alone, batched, shuffled) in the same mode. GPU: not measured on GPU.
"""
from __future__ import annotations

import contextlib

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


def _wider(model_type: str):
    """A hidden-512 model of ``model_type`` (random weights), where the arithmetic counts more
    than the per-op overhead: Llama with 4 layers (sdpa), GLM-5 with 2 (eager: MLA, the DSA
    indexer over 4 heads of 64, MoE)."""
    import transformers
    from glm_kernels.testing import tiny_causal_lm
    config = tiny_causal_lm(model_type).config
    common = dict(hidden_size=512, intermediate_size=1024, vocab_size=1024,
                  max_position_embeddings=512)
    if model_type == "llama":
        common.update(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64)
    else:
        common.update(num_attention_heads=8, num_key_value_heads=8, moe_intermediate_size=256,
                      q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32,
                      qk_nope_head_dim=32, v_head_dim=64, index_head_dim=64, index_n_heads=4,
                      index_topk=512)
    # Rebuilt from its fields: a config derives some sizes (GLM-5's qk_head_dim) in __init__.
    fields = {k: v for k, v in config.to_dict().items() if k != "qk_head_dim"}
    config = type(config)(**{**fields, **common},
                          attn_implementation=config._attn_implementation)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _model_rows(quick: bool) -> list:
    """Forward and decode of each tiny model (and, unless quick, of two hidden-512 models),
    off and on, on the CPU (fp32, one thread)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("note: transformers is not installed: whole-model rows skipped")
        return []
    from glm_kernels.testing import TINY_MODEL_TYPES, _left_pad, tiny_causal_lm
    g = torch.Generator().manual_seed(0)
    rows_in = [torch.randint(1, 96, (16 + (4 * i) % 17,), generator=g) for i in range(8)]
    tiny = (_left_pad(rows_in, 0), [r[:4 + i % 5] for i, r in enumerate(rows_in)], 8)
    rows_in = [torch.randint(1, 1024, (128 - 24 * i,), generator=g) for i in range(4)]
    wide = (_left_pad(rows_in, 0), [r[:8 + 4 * i] for i, r in enumerate(rows_in)], 32)
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model_type in TINY_MODEL_TYPES:
            rows += _time_model(model_type, tiny_causal_lm(model_type), *tiny, quick)
        for model_type in () if quick else ("llama", "glm_moe_dsa"):
            rows += _time_model(f"{model_type} h512", _wider(model_type), *wide, quick)
    finally:
        torch.set_num_threads(threads)
    return rows


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that runs every op unchanged: what intercepting every aten op in Python
    costs before any work (the design ``batch_invariant()`` used before its registered
    kernels; still its path inside ``torch.inference_mode()``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _registered_floor():
    """The override's kernels registered for the same ops, switch on, each passing its call
    through: what reaching the covered and reported ops costs before any work (the floor of
    ``batch_invariant()``'s design)."""
    from glm_kernels._dispatch import batch_invariant_switch
    from glm_kernels.invariant import mode
    from glm_kernels.invariant._registry import PASS_THROUGH, Registration
    floor = Registration(mode._registered_ops, lambda op, args, kwargs: PASS_THROUGH,
                         lambda: False)
    floor.acquire()
    try:
        with batch_invariant_switch(True):
            yield
    finally:
        floor.release()


def _time_model(name, model, batch, prompts, new_tokens, quick) -> list:
    """One model's forward (``batch``: ids, mask, positions) and decode (``prompts``, left-
    padded, ``new_tokens`` sampled) rows: off, pass-through and on side by side, and the
    bitwise check."""
    from glm_kernels.testing import _left_pad, assert_batch_invariant
    ids, mask, positions = batch
    p_ids, p_mask, _ = _left_pad(prompts, 0)
    rows = []

    def forward(m=model):
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=mask, position_ids=positions,
                     use_cache=False).logits

    def decode(m=model):
        torch.manual_seed(0)
        with torch.no_grad():
            return m.generate(p_ids, attention_mask=p_mask, do_sample=True,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0)

    repeats = 3 if quick or new_tokens > 8 else 7
    for label, fn in ((f"forward {ids.shape[0]}x<={ids.shape[1]}", forward),
                      (f"decode {p_ids.shape[0]}x{new_tokens} new", decode)):
        row = {"case": f"{name} {label} fp32 cpu"}
        # The mechanism's own floor (registered kernels that pass every call through), and
        # a dispatch mode's (every op through Python).
        for column, floor in (("floor", _registered_floor), ("mode_floor", _PassThrough)):
            with floor():
                row[f"{column}_ms"] = _common.time_fn(fn, device="cpu", warmup=1,
                                                      repeats=repeats, process_clock=True) * 1e3
        for mode in ("off", "on"):
            with glm_kernels.batch_invariant(mode == "on"):
                # Process CPU time on one thread: the machine is shared, and the wall
                # clock would also count the time spent waiting for a core.
                row[f"{mode}_ms"] = _common.time_fn(fn, device="cpu", warmup=1,
                                                    repeats=repeats, process_clock=True) * 1e3
                if label.startswith("decode"):
                    try:
                        assert_batch_invariant(model, prompts[:3], max_new_tokens=3)
                        row[f"bitwise_{mode}"] = True
                    except AssertionError:
                        row[f"bitwise_{mode}"] = False
        row["on_vs_off"] = row["on_ms"] / row["off_ms"]
        row["floor_vs_off"] = row["floor_ms"] / row["off_ms"]
        row["mode_floor_vs_off"] = row["mode_floor_ms"] / row["off_ms"]
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
                        model_rows, ["case", "off_ms", "on_ms", "on_vs_off", "floor_ms",
                                     "floor_vs_off", "mode_floor_vs_off", "bitwise_off",
                                     "bitwise_on"])
    result = {"device": device, "environment": _common.environment(), "rows": rows,
              "model_rows": model_rows}
    notes = {"gpu": "measured" if on_gpu else "not measured on GPU",
             "models": "CPU only; whole-model rows not measured on GPU"}
    return _common.finish(result, notes, {})


if __name__ == "__main__":
    _common.main(__doc__, run)
