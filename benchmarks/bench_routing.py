"""Rollout routing replay (R3): wire size of routed expert ids, codec time, replay vs routing.

Tables:
  encoding  bytes per token per MoE layer of one sequence's routing packet
            (``glm_kernels.topk.encode_routing``: 1 B/id for <= 256 experts, 2 B above, 28 B
            header + checksum per sequence) against int64 ids (8 B/id), for GLM-5 (256
            experts, top-8, 75 MoE layers... any count: bytes/token/layer barely depends on it)
            and other shapes; encode and decode time per sequence on this device.
  replay    ``moe_route`` normal routing vs replay (``replay_ids``) vs replay with the
            mismatch flag (``return_mismatch=True``), 256 experts, top-8, 8 groups / top-4,
            sigmoid + bias; every replayed result checked (ids bitwise, weights bitwise when
            the ids are the normal path's own).
  transformers  the MoE router of transformers' own GLM-5 model (``GlmMoeDsaMoE
            .route_tokens_to_experts``: torch.topk, ties however the backend breaks them) against
            the same module patched by ``glm_kernels.integrations.transformers``
            (``moe_route``), on the same router logits (256 experts, top-8, 8 groups / top-4,
            scaling 2.5): time per call, and how often the two pick the same expert set.
On GPU the kernels run compiled (do_bench medians); with --cpu the torch reference path is
timed (labelled) and the Triton interpreter is checked and timed on 64 tokens (labelled:
the interpreter runs each program in Python, so its numbers say nothing about GPU speed).

    python benchmarks/bench_routing.py [--quick] [--cpu] [--json out.json]
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
from glm_kernels.topk import (_reference, decode_routing, encode_routing,  # noqa: E402
                              moe_route, routing_header)

# (label, n_experts, k): GLM-5 / DeepSeek-V3, a 512-expert model (2-byte ids), Qwen-style
# 64 experts top-6, the example trainer's 4 experts top-2.
SHAPES = [("GLM-5", 256, 8), ("512 experts", 512, 8), ("64 experts", 64, 6),
          ("example trainer", 4, 2)]


def _routed(n_layers, n_tokens, k, n_experts, device):
    gen = torch.Generator().manual_seed(n_experts * 31 + k)
    scores = torch.rand(n_tokens, n_experts, generator=gen)
    ids = scores.topk(k, dim=-1).indices                       # distinct per token
    shift = torch.randint(0, n_experts, (n_layers, 1, 1), generator=gen)
    return ((ids[None] + shift) % n_experts).to(device)        # [layers, tokens, k]


def bench_encoding(label, n_experts, k, n_layers, n_tokens, device, notes):
    ids = _routed(n_layers, n_tokens, k, n_experts, device)
    packet = encode_routing(ids, n_experts)
    wire = packet.cpu().numpy().tobytes()
    exact = bool(torch.equal(decode_routing(wire, device=device), ids)
                 and torch.equal(decode_routing(packet), ids))
    pairs = n_layers * n_tokens
    row = {"shape": label, "experts": n_experts, "k": k, "layers": n_layers,
           "tokens": n_tokens, "packet_B": len(wire), "int64_B": ids.numel() * 8,
           "B/token/layer": len(wire) / pairs, "int64_B/token/layer": 8.0 * k,
           "id_bytes": routing_header(wire).id_bytes, "round_trip_exact": exact}
    row["x_smaller"] = row["int64_B"] / row["packet_B"]
    for name, fn in (("encode", lambda: encode_routing(ids, n_experts)),
                     ("decode_bytes", lambda: decode_routing(wire, device=device)),
                     ("decode_tensor", lambda: decode_routing(packet))):
        try:
            row[f"{name}_us"] = _common.time_fn(fn, device=device) * 1e6
        except Exception as exc:
            notes[f"{name}@{label}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return row


def bench_replay(tokens, device, notes, timed=True):
    k, n_experts = 8, 256
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(tokens, n_experts, generator=gen).to(device)
    bias = (torch.randn(n_experts, generator=gen) * 0.1).to(device)
    kwargs = dict(bias=bias, n_group=8, topk_group=4, scaling_factor=2.5)
    normal = moe_route(logits, k, **kwargs)
    # A recorded routing that differs on ~1 token in 4 (one expert swapped).
    recorded = normal.ids.clone()
    swap = torch.arange(tokens, device=device) % 4 == 0
    spare = (normal.ids.max(dim=1).values + 1) % n_experts
    spare = torch.where((normal.ids == spare[:, None]).any(1), (spare + 1) % n_experts, spare)
    recorded[:, -1] = torch.where(swap, spare, recorded[:, -1])
    own = moe_route(logits, k, replay_ids=normal.ids, return_mismatch=True, **kwargs)
    replay = moe_route(logits, k, replay_ids=recorded, return_mismatch=True, **kwargs)
    ref_w = _reference.moe_route_reference(logits, k, replay_ids=recorded, **kwargs)[0]
    row = {"tokens": tokens,
           "own_ids_bitwise": bool(torch.equal(own.ids, normal.ids)
                                   and torch.equal(own.weights, normal.weights)),
           "replay_ids_bitwise": bool(torch.equal(replay.ids, recorded)),
           "replay_weights_rel_err": float((replay.weights - ref_w).norm() / ref_w.norm()),
           "mismatch_rate": float(replay.mismatch.float().mean())}
    if not timed:
        return row
    providers = {
        "route": lambda: moe_route(logits, k, **kwargs),
        "replay": lambda: moe_route(logits, k, replay_ids=recorded, **kwargs),
        "replay_mismatch": lambda: moe_route(logits, k, replay_ids=recorded,
                                             return_mismatch=True, **kwargs)}
    for name, fn in providers.items():
        try:
            row[f"{name}_us"] = _common.time_fn(fn, device=device) * 1e6
        except Exception as exc:
            notes[f"{name}@{tokens}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    if row.get("route_us"):
        for name in ("replay", "replay_mismatch"):
            if row.get(f"{name}_us"):
                row[f"{name}/route"] = row[f"{name}_us"] / row["route_us"]
    return row


def bench_transformers(tokens, device, notes):
    """transformers' GLM-5 router vs the patched one, side by side on the same logits."""
    try:
        import copy

        from transformers import GlmMoeDsaConfig
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE

        from glm_kernels.integrations.transformers import apply_glm_kernels  # noqa: F401
        from glm_kernels.integrations.transformers._routers import (
            noaux_route_tokens_to_experts, noaux_router_forward)
    except ImportError as exc:
        notes["transformers"] = f"skipped: {exc}"
        return None
    import types
    config = GlmMoeDsaConfig(hidden_size=64, moe_intermediate_size=16, n_routed_experts=256,
                             num_experts_per_tok=8, n_group=8, topk_group=4,
                             routed_scaling_factor=2.5, n_shared_experts=1)
    theirs = GlmMoeDsaMoE(config).to(device)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        theirs.gate.e_score_correction_bias.copy_(torch.randn(256, generator=gen) * 0.1)
    ours = copy.deepcopy(theirs)
    # transformers <= 5.10 routes in the MoE block from the router's logits; newer releases
    # route in the router's forward from the hidden states (its gemm timed on both sides)
    if hasattr(theirs, "route_tokens_to_experts"):
        ours.route_tokens_to_experts = types.MethodType(noaux_route_tokens_to_experts, ours)
        inputs, kind = torch.randn(tokens, 256, generator=gen).to(device), "router logits"

        def call(module):
            return module.route_tokens_to_experts(inputs)
    else:
        ours.gate.forward = types.MethodType(noaux_router_forward, ours.gate)
        inputs, kind = torch.randn(tokens, 64, generator=gen).to(device), "hidden states"

        def call(module):
            _, weights, ids = module.gate(inputs)
            return ids, weights
    (their_ids, their_w), (our_ids, our_w) = [
        (ids, weights.detach()) for ids, weights in (call(theirs), call(ours))]
    same = (their_ids.sort(-1).values == our_ids.sort(-1).values).all(-1)
    their_w = their_w.gather(1, their_ids.argsort(-1))
    our_w = our_w.gather(1, our_ids.argsort(-1))
    row = {"tokens": tokens, "input": kind,
           "same_expert_set": float(same.float().mean()),
           "weights_rel_err": float((our_w[same] - their_w[same]).norm()
                                    / their_w[same].norm())}
    for name, module in (("transformers", theirs), ("glm_kernels", ours)):
        try:
            row[f"{name}_us"] = _common.time_fn(
                lambda: call(module), device=device) * 1e6
        except Exception as exc:
            notes[f"transformers:{name}@{tokens}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    if row.get("transformers_us") and row.get("glm_kernels_us"):
        row["glm_kernels/transformers"] = row["glm_kernels_us"] / row["transformers_us"]
    return row


def run(quick: bool = False, cpu: bool = False) -> dict:
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    on_gpu = device == "cuda"
    notes = {}
    n_layers = 75 if not quick else 8
    seq = (4096, 32768) if on_gpu and not quick else (4096,)
    enc_rows = [bench_encoding(label, e, k, n_layers, t, device, notes)
                for label, e, k in SHAPES for t in seq]
    backend = _dispatch.select_backend("moe_route", torch.empty(1, device=device))
    replay_tokens = (16384, 65536) if on_gpu and not quick else (16384,) if on_gpu else (2048,)
    replay_rows = [bench_replay(t, device, notes) for t in replay_tokens]
    where = (f"on {device}, backend {backend}" + ("" if on_gpu else
             " (CPU: torch reference path; not a GPU figure)"))
    _common.print_table(f"routing packet size and codec time ({n_layers} MoE layers, {where})",
                        enc_rows, ["shape", "experts", "k", "tokens", "packet_B", "int64_B",
                                   "B/token/layer", "int64_B/token/layer", "x_smaller",
                                   "encode_us", "decode_bytes_us", "decode_tensor_us",
                                   "round_trip_exact"])
    _common.print_table(f"moe_route: routing vs replay (256 experts, k = 8, 8 groups / top-4; "
                        f"{where})", replay_rows,
                        ["tokens", "route_us", "replay_us", "replay_mismatch_us",
                         "replay/route", "replay_mismatch/route", "own_ids_bitwise",
                         "replay_ids_bitwise", "replay_weights_rel_err", "mismatch_rate"])
    hf_rows = [r for r in (bench_transformers(t, device, notes) for t in replay_tokens) if r]
    if hf_rows:
        _common.print_table(f"transformers' GLM-5 router vs patched by glm_kernels (256 "
                            f"experts, k = 8, 8 groups / top-4; {where})", hf_rows,
                            ["tokens", "transformers_us", "glm_kernels_us",
                             "glm_kernels/transformers", "same_expert_set",
                             "weights_rel_err"])
    result = {"benchmark": "routing", "device": device, "glm_kernels_backend": backend,
              "encoding": enc_rows, "replay": replay_rows, "transformers": hf_rows,
              "notes": notes,
              "fallbacks": _dispatch.fallbacks_logged(), "env": _common.environment()}
    if not on_gpu and _dispatch.interpreter_active() and _dispatch.triton_available():
        with glm_kernels.force_backend("interpret"):
            check = bench_replay(64, "cpu", notes)
        _common.print_table("moe_route in the Triton INTERPRETER (64 tokens; Python-simulated "
                            "programs: a check, not a speed figure)", [check],
                            ["tokens", "route_us", "replay_us", "replay_mismatch_us",
                             "replay/route", "replay_mismatch/route", "own_ids_bitwise",
                             "replay_ids_bitwise", "replay_weights_rel_err", "mismatch_rate"])
        result["interpreter_check"] = check
    for key, note in notes.items():
        print(f"note: {key}: {note}")
    return result


if __name__ == "__main__":
    _common.main(__doc__, run)
