"""R3 from SGLang: ``routed_experts_from_sglang`` / ``routing_packet_from_sglang`` on routed
experts built the way SGLang builds them (sgl-project/sglang,
python/sglang/srt/layers/moe/routed_experts_capturer.py: the host buffer is int32
[tokens, num_hidden_layers, num_experts_per_tok], ``get_routed_experts`` returns the rows of
the request's first seqlen - 1 tokens, the detokenizer base64-encodes their bytes into
``meta_info["routed_experts"]``; dense layers are never captured and stay 0; with EPLB the
captured ids are physical). SGLang itself needs a GPU build and is not installed here: the
engine below routes with ``moe_route`` and encodes as SGLang does, and slime's decoder
(``np.frombuffer(b64decode(...), np.int32).reshape(len(tokens) - 1, num_layers, topk)``)
reads the same bytes as a cross-check."""
import base64

import numpy as np
import pytest
import torch

from glm_kernels.integrations import sglang as plug
from glm_kernels.topk import decode_routing_batch, moe_route, routing_header

N_LAYERS, DENSE, N_EXPERTS, K = 4, 1, 16, 3          # layer 0 dense (first_k_dense_replace=1)
MOE_LAYERS = list(range(DENSE, N_LAYERS))


def engine_logits(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(MOE_LAYERS), num_tokens, N_EXPERTS, generator=gen) * 2


def sglang_output(logits, *, logical_to_physical=None):
    """{"meta_info": {"routed_experts": base64}} for one request whose tokens have the given
    router logits per MoE layer, as SGLang returns it (the last token is never run)."""
    num_tokens = logits.shape[1]
    buffer = np.zeros((num_tokens - 1, N_LAYERS, K), dtype=np.int32)     # dense rows stay 0
    for i, layer in enumerate(MOE_LAYERS):
        ids = moe_route(logits[i, :-1], K, n_group=4, topk_group=2).ids
        if logical_to_physical is not None:
            ids = logical_to_physical[layer][ids]
        buffer[:, layer] = ids.numpy()
    return {"text": "...", "meta_info": {"routed_experts":
                                         base64.b64encode(buffer.tobytes()).decode("ascii")}}


def slime_decode(output, num_tokens):
    """slime's rollout side (slime/rollout/sglang_rollout.py) reading the same field."""
    raw = base64.b64decode(output["meta_info"]["routed_experts"].encode("ascii"))
    return np.frombuffer(raw, dtype=np.int32).reshape(num_tokens - 1, N_LAYERS, K)


def adapt(output, num_tokens, **kwargs):
    kwargs = {"num_tokens": num_tokens, "num_layers": N_LAYERS, "top_k": K,
              "n_experts": N_EXPERTS, "moe_layers": MOE_LAYERS, **kwargs}
    return plug.routed_experts_from_sglang(output, **kwargs)


def test_ids_are_what_the_engine_routed_and_replay_bitwise():
    """Three requests of different lengths: SGLang's output -> packet -> trainer batch ->
    moe_route replay gives the engine's experts and its weight bits, no mismatch."""
    lengths = [9, 1, 5]
    logits = [engine_logits(n, seed=n) for n in lengths]
    outputs = [sglang_output(lg) for lg in logits]
    packets = []
    for n, lg, out in zip(lengths, logits, outputs):
        ids = adapt(out, n)
        assert ids.dtype == torch.int64 and ids.shape == (len(MOE_LAYERS), n, K)
        assert torch.equal(ids[:, :n - 1],
                           torch.from_numpy(slime_decode(out, n)[:, MOE_LAYERS].copy())
                           .long().transpose(0, 1))
        assert torch.equal(ids[:, n - 1], torch.arange(K).expand(len(MOE_LAYERS), K))
        # the same from meta_info, from the string and from the decoded bytes
        text = out["meta_info"]["routed_experts"]
        for form in (out["meta_info"], text, base64.b64decode(text)):
            assert torch.equal(adapt(form, n), ids)
        packets.append(plug.routing_packet_from_sglang(
            out, num_tokens=n, num_layers=N_LAYERS, top_k=K, n_experts=N_EXPERTS,
            moe_layers=MOE_LAYERS).numpy().tobytes())
        assert routing_header(packets[-1])[2:] == (N_EXPERTS, len(MOE_LAYERS), n, K)
    batch = decode_routing_batch(packets)
    assert batch.lengths.tolist() == lengths
    for b, (n, lg) in enumerate(zip(lengths, logits)):
        for i in range(len(MOE_LAYERS)):
            own = moe_route(lg[i, :n - 1], K, n_group=4, topk_group=2)
            replay = moe_route(lg[i, :n], K, n_group=4, topk_group=2,
                               replay_ids=batch.ids[i, b, :n], return_mismatch=True)
            assert torch.equal(replay.ids[:n - 1], own.ids)
            assert torch.equal(replay.weights[:n - 1], own.weights)     # same ids, same bits
            assert not bool(replay.mismatch[:n - 1].any())


def test_physical_ids_under_eplb_map_back_to_logical():
    """EPLB: 16 logical experts on 20 physical slots per layer (4 redundant), SGLang records
    the physical slot; SGLang's physical_to_logical_map brings back the logical ids."""
    gen = torch.Generator().manual_seed(3)
    physical_to_logical = torch.stack([torch.cat([torch.arange(N_EXPERTS),
                                                  torch.randint(0, N_EXPERTS, (4,),
                                                                generator=gen)])
                                       [torch.randperm(N_EXPERTS + 4, generator=gen)]
                                       for _ in range(N_LAYERS)])
    logical_to_physical = [torch.tensor([int((row == e).nonzero()[-1]) for e in range(N_EXPERTS)])
                           for row in physical_to_logical]
    logits = engine_logits(7, seed=7)
    out = sglang_output(logits, logical_to_physical=logical_to_physical)
    plain = adapt(sglang_output(logits), 7)
    assert not torch.equal(adapt(out, 7, physical_to_logical=physical_to_logical.int())[:, :6],
                           torch.from_numpy(slime_decode(out, 7)[:, MOE_LAYERS].copy()).long()
                           .transpose(0, 1))                    # the raw ids were physical
    assert torch.equal(adapt(out, 7, physical_to_logical=physical_to_logical), plain)
    with pytest.raises(ValueError, match=r"expected ids in \[0, 16\) \(n_experts\)"):
        adapt(out, 7)                       # physical slots >= 16 without the map
    with pytest.raises(ValueError, match=r"physical_to_logical must have shape \[num_layers=4"):
        adapt(out, 7, physical_to_logical=physical_to_logical[:2])
    with pytest.raises(ValueError, match="maps to ids outside"):
        adapt(out, 7, physical_to_logical=physical_to_logical + N_EXPERTS)


def test_lengths_are_checked_before_decoding(monkeypatch):
    """A text whose length does not match the declared shape is refused before base64 runs or
    any buffer is allocated (a huge num_tokens costs nothing)."""
    out = sglang_output(engine_logits(6, seed=6))
    text = out["meta_info"]["routed_experts"]

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded before the length check")
    monkeypatch.setattr(plug.base64, "b64decode", no_decode)
    for n, bad in ((7, text), (5, text), ((1 << 31) - 1, text), (6, text[:-4]),
                   (6, text + "AAAA")):
        with pytest.raises(ValueError, match="base64 characters, but"):
            adapt(bad, n)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="bytes, but 5 rows"):
        adapt(base64.b64decode(text)[:-1], 6)
    with pytest.raises(ValueError, match="not valid base64"):
        adapt("!" + text[1:], 6)


def test_bad_ids_and_arguments_name_the_problem():
    n = 5
    buffer = np.zeros((n - 1, N_LAYERS, K), dtype=np.int32)
    buffer[:, MOE_LAYERS] = np.arange(K, dtype=np.int32)

    def encoded(buf):
        return base64.b64encode(buf.tobytes()).decode()
    assert torch.equal(adapt(encoded(buffer), n)[:, :n - 1],
                       torch.arange(K).expand(len(MOE_LAYERS), n - 1, K))
    bad = buffer.copy()
    bad[2, 3, 1] = N_EXPERTS
    with pytest.raises(ValueError, match=r"layer 3 token 2 has ids \[0, 16, 2\]"):
        adapt(encoded(bad), n)
    bad = buffer.copy()
    bad[1, 2, 0] = -1
    with pytest.raises(ValueError, match=r"layer 2 token 1 has ids \[-1, 1, 2\]"):
        adapt(encoded(bad), n)
    bad = buffer.copy()
    bad[3, 1, 2] = 0
    with pytest.raises(ValueError, match=r"layer 1 token 3 has ids \[0, 1, 0\].*distinct"):
        adapt(encoded(bad), n)
    with pytest.raises(ValueError, match=r"layer 0 token 0 .*dense layer in moe_layers"):
        adapt(encoded(buffer), n, moe_layers=[0, 1])    # the dense layer's rows are zeros
    assert adapt("", 1).tolist() == [[[0, 1, 2]]] * len(MOE_LAYERS)   # prompt of one token
    with pytest.raises(ValueError, match="no meta_info\\['routed_experts'\\].*"
                                         "return_routed_experts=True"):
        adapt({"text": "x", "meta_info": {}}, n)
    with pytest.raises(TypeError, match="must be SGLang's generate output"):
        adapt(buffer, n)
    for name, value in (("num_tokens", 0), ("num_tokens", True), ("top_k", 17),
                        ("n_experts", 0), ("num_layers", 2.0)):
        kwargs = dict(num_tokens=n, num_layers=N_LAYERS, top_k=K, n_experts=N_EXPERTS)
        kwargs[name] = value
        with pytest.raises(ValueError, match=f"{name} must be an int"):
            plug.routed_experts_from_sglang(encoded(buffer), **kwargs)
    for layers, error in (([1, 1], ValueError), ([], ValueError), ([4], ValueError),
                          (3, TypeError)):
        with pytest.raises(error, match="moe_layers"):
            adapt(encoded(buffer), n, moe_layers=layers)
