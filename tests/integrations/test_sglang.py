"""SGLang-side delta receiver on CPU: the engine calls ``loader(model, named_tensors)`` from
``update_weights_from_tensor(load_format=<loader path>)`` (sgl-project/sglang,
python/sglang/srt/model_executor/model_runner.py); here a small bf16 module stands in for the
engine's model."""
import pytest
import torch

from glm_kernels import sync
from glm_kernels.integrations import sglang as plug


class Engine(torch.nn.Module):
    """Parameter layout of an SGLang attention block: fused qkv, separate output projection."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(16, 48, bias=False).to(torch.bfloat16)
        self.o_proj = torch.nn.Linear(16, 16, bias=False).to(torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))


def engine_call(model, named_tensors, load_format=plug.LOADER):
    """What ModelRunner.update_weights_from_tensor does with a custom loader."""
    named_tensors = [(n, t.to("cpu")) for n, t in named_tensors]      # _unwrap_tensor
    loader = {plug.LOADER: plug.load_delta_frames}[load_format]        # dynamic_import
    loader(model, named_tensors)


def trainer_weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {"qkv_proj.weight": torch.randn(48, 16, generator=g).bfloat16(),
            "o_proj.weight": torch.randn(16, 16, generator=g).bfloat16(),
            "norm": torch.ones(16, dtype=torch.bfloat16)}


def nudge(weights, seed):
    """An optimizer step on bf16 weights: a few elements move by one ulp."""
    g = torch.Generator().manual_seed(seed)
    for t in weights.values():
        flat = t.view(torch.int16).reshape(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:5]
        flat[idx] += 1


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_full_then_delta_updates_apply_in_place():
    engine, w = Engine(), trainer_weights(0)
    ptrs = {n: p.data_ptr() for n, p in engine.named_parameters()}
    sender = plug.SGLangDeltaSender()
    version, named = sender.publish(w)
    assert version == 1 and sender.last_stats.full
    assert all(t.dtype == torch.uint8 for _, t in named)
    engine_call(engine, named)
    for step in range(2, 5):
        nudge(w, step)
        version, named = sender.publish(w)
        assert not sender.last_stats.full and sender.last_stats.changed == 15
        engine_call(engine, named)
        assert plug.delta_version(engine) == version == step
    for n, p in engine.named_parameters():
        assert torch.equal(p.view(torch.int16), w[n].view(torch.int16)) and p.data_ptr() == ptrs[n]


def test_refused_updates_leave_weights_unchanged_and_full_snapshot_recovers():
    engine, w = Engine(), trainer_weights(1)
    sender = plug.SGLangDeltaSender()
    engine_call(engine, sender.publish(w)[1])
    nudge(w, 1)
    sender.publish(w)                            # v2 never reaches the engine
    nudge(w, 2)
    _, named = sender.publish(w)                 # v3 is a delta on v2
    before = snapshot(engine)
    with pytest.raises(sync.VersionError):
        engine_call(engine, named)
    assert all(torch.equal(p, before[n]) for n, p in engine.named_parameters())
    # A corrupt payload byte is refused too, before anything is written.
    sender.request_full()
    version, named = sender.publish(w)
    assert sender.last_stats.full
    bad = [(n, t.clone()) for n, t in named]
    data = next(t for n, t in bad if n.endswith("/data"))
    data[data.numel() // 2] ^= 0xFF
    with pytest.raises(sync.SyncError):
        engine_call(engine, bad)
    assert all(torch.equal(p, before[n]) for n, p in engine.named_parameters())
    engine_call(engine, named)                   # the intact full snapshot applies
    assert plug.delta_version(engine) == version
    assert all(torch.equal(p, w[n]) for n, p in engine.named_parameters())


def test_foreign_tensor_names_are_refused():
    engine = Engine()
    with pytest.raises(sync.SyncError, match="unexpected tensor"):
        engine_call(engine, [("model.layers.0.qkv_proj.weight", torch.zeros(4, dtype=torch.uint8))])
    sender = plug.SGLangDeltaSender()
    _, named = sender.publish({"not_a_param": torch.zeros(3)})
    with pytest.raises(sync.SyncError):
        engine_call(engine, named)


def test_registered_views_route_unfused_names_into_a_fused_weight():
    engine = Engine()
    qkv = engine.qkv_proj.weight.data
    plug.register_delta_params(engine, {"q_proj.weight": qkv[:16], "k_proj.weight": qkv[16:32],
                                        "v_proj.weight": qkv[32:]})
    g = torch.Generator().manual_seed(5)
    hf = {n: torch.randn(16, 16, generator=g).bfloat16()
          for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
    sender = plug.SGLangDeltaSender()
    engine_call(engine, sender.publish(hf)[1])
    nudge(hf, 3)
    engine_call(engine, sender.publish(hf)[1])
    assert torch.equal(engine.qkv_proj.weight, torch.cat([hf["q_proj.weight"], hf["k_proj.weight"],
                                                          hf["v_proj.weight"]]))
    with pytest.raises(RuntimeError, match="before the first"):
        plug.register_delta_params(engine, {"x": qkv[:1]})


def test_zstd_bomb_in_a_delta_update_refused_with_bounded_memory():
    """A sealed delta for the 16-element ``norm`` whose zstd frame declares 32 MiB (issue 17):
    refused before decompressing, weights unchanged, no allocation of the declared size."""
    import struct
    import tracemalloc

    zstandard = pytest.importorskip("zstandard")
    from glm_kernels.delta import DeltaPacket
    from glm_kernels.sync.protocol import delta_entry, pack

    engine, w = Engine(), trainer_weights(2)
    sender = plug.SGLangDeltaSender()
    engine_call(engine, sender.publish(w)[1])
    zc = zstandard.ZstdCompressor(level=1)
    streams = [b"", zc.compress(bytes(32 << 20))] + [zc.compress(bytes(16)) for _ in range(3)]
    payload = struct.pack("<5Q", *map(len, streams)) + b"".join(streams)
    bomb = DeltaPacket(torch.bfloat16, 16, "zstd", 16, 0, bytes(8), b"", payload)
    frames = pack(2, 1, iter([delta_entry("norm", (16,), bomb)]), 1 << 20,
                  epoch=sender._sender.epoch)
    named = plug.frames_to_named_tensors(list(frames))
    before = snapshot(engine)
    tracemalloc.start()
    try:
        with pytest.raises(sync.SyncError, match="declares"):
            engine_call(engine, named)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    assert all(torch.equal(p, before[n]) for n, p in engine.named_parameters())
    assert plug.delta_version(engine) == 1


def test_malformed_named_tensors_are_a_sync_error():
    engine = Engine()
    for bad in ([("glm_kernels.sync/0/meta", [1, 2])], [("glm_kernels.sync/0/meta",)], [7]):
        with pytest.raises(sync.SyncError, match="pairs"):
            plug.load_delta_frames(engine, bad)
