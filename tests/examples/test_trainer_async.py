import pytest
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.packing import karmarkar_karp, first_fit
from examples.async_trainer.buffer import DataBuffer
from examples.async_trainer.trainer import train


def test_bad_config_raises():
    with pytest.raises(ValueError, match="group_size"):
        TrainerConfig(group_size=1).validate()
    with pytest.raises(ValueError, match="packing"):
        TrainerConfig(packing="x").validate()


def test_packing_and_buffer():
    lengths = [9, 8, 7, 6, 5, 4]
    parts = karmarkar_karp(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert abs(sum(lengths[i] for i in parts[0]) - sum(lengths[i] for i in parts[1])) <= 1
    assert all(sum(lengths[i] for i in b) <= 12 for b in first_fit(lengths, 12))
    buf = DataBuffer(2)
    buf.add({"prompt_id": 0}); assert buf.pop_ready(4) == []
    buf.add({"prompt_id": 0}); assert len(buf.pop_ready(4)) == 1 and buf.pop_ready(4) == []
    with pytest.raises(ValueError):
        buf.add({"prompt_id": 0})


def test_short_run_learns_and_counts_samples(tmp_path):
    cfg = TrainerConfig(rl_steps=30, out_dir=str(tmp_path))
    out = train(cfg)
    sft_r = [r for r in out["records"] if r["stage"] == "sft"][0]["eval_reward"]
    assert out["final_eval"] > sft_r + 0.1, (sft_r, out["final_eval"])
    ids = out["trained_ids"]
    assert len(ids) == len(set(ids)) == 30 * cfg.prompts_per_step * cfg.group_size
    assert (tmp_path / "checkpoint.pt").exists()
