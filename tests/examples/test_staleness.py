"""The staleness bound holds across the CLI's batch settings, on both rollout backends: no
group is trained more than ``max_ahead_steps`` weight versions after the one it was
generated with (issue 24: a small ``--prompts-per-step`` with the default
``--rollout-batch-samples`` reached 8 at ``max_ahead_steps`` 1)."""
import pytest

from examples.async_trainer.trainer import train
from examples.async_trainer.config import TrainerConfig


@pytest.mark.xdist_group("ray")                    # see tests/conftest.py
@pytest.mark.parametrize("backend, prompts_per_step, batch, ahead", [
    ("process", 1, 64, 1),      # the issue's setting: a batch is 32 steps' worth of prompts
    ("ray", 1, 64, 1),
    ("ray", 3, 256, 2),
])
def test_staleness_never_exceeds_max_ahead_steps(tmp_path, backend, prompts_per_step, batch,
                                                 ahead):
    if backend == "ray":
        pytest.importorskip("ray")
    cfg = TrainerConfig(tasks="reverse", sft_steps=1, rl_steps=8, opd_steps=0, group_size=2,
                        prompts_per_step=prompts_per_step, rollout_batch_samples=batch,
                        max_ahead_steps=ahead, eval_prompts=4, progress=False,
                        rollout_backend=backend, out_dir=str(tmp_path))
    out = train(cfg)
    rl = [r for r in out["records"] if r.get("stage") == "rl:reverse" and r["kind"] == "train"]
    assert len(rl) == cfg.rl_steps
    assert max(r["staleness_max"] for r in rl) <= ahead, [r["staleness_max"] for r in rl]
    acc = out["accounting"]["rl:reverse"]
    assert acc["generated"] == acc["trained"] + acc["unconsumed"] + acc["stale"] + acc["dropped"]
    assert acc["dropped"] == 0, acc
