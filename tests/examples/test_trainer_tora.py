"""The ToRA task as a stage of the trainer: the command line's default task list, the SFT and
OPD mixes over three tasks, and RL / OPD stages of multi-turn sessions on the rollout process
(the backend without Ray) and on Ray engine actors, with every sample accounted for and the
fork count in the metrics."""
import json
import sys

import pytest

from examples.async_trainer.__main__ import main as cli_main
from examples.async_trainer.__main__ import parse
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.trainer import train

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandbox: Linux")


def test_the_demo_has_three_tasks_and_mixes_them():
    cfg = parse([]).validate()
    assert cfg.task_list() == ["reverse", "tool", "tora"]
    assert parse(["--tasks", "reverse"]).tasks == "reverse"
    assert cfg.sft_order() == ["reverse"] * 3 + ["tool"] * 2 + ["tora"] * 4
    mix = cfg.opd_mix()
    assert mix["reverse"] == cfg.opd_ratio and abs(sum(mix.values()) - 1.0) < 1e-12
    assert mix["tool"] == mix["tora"]
    assert TrainerConfig(tasks="reverse,tool").opd_mix() == {"reverse": 0.4, "tool": 0.6}
    assert TrainerConfig(tasks="reverse,tool").sft_order() == ["reverse"] * 3 + ["tool"] * 2


@pytest.mark.parametrize("weights", ["tora", "tora=0", "sort=2", "tora=x"])
def test_bad_sft_weights_name_the_field(weights, capsys):
    with pytest.raises(ValueError, match="sft_weights"):
        TrainerConfig(sft_weights=weights).validate()
    assert cli_main(["--sft-weights", weights]) == 2
    assert "--sft-weights" in capsys.readouterr().err


@pytest.mark.xdist_group("ray")                    # see tests/conftest.py
@pytest.mark.parametrize("backend", ["process", "ray"])
def test_tora_stages_on_either_rollout_backend(tmp_path, backend):
    if backend == "ray":
        pytest.importorskip("ray")
    cfg = TrainerConfig(tasks="tora", sft_steps=4, rl_steps=3, opd_steps=2, prompts_per_step=2,
                        group_size=4, opd_prompts_per_step=4, eval_prompts=4, progress=False,
                        rollout_backend=backend, out_dir=str(tmp_path))
    out = train(cfg)
    assert out["exit_code"] == 0 and set(out["evals"]) == {"sft", "rl:tora", "opd"}
    for stage, samples in (("rl:tora", 3 * 8), ("opd", 2 * 4)):
        ids = out["trained_ids"][stage]
        assert len(ids) == len(set(ids)) == samples                      # none trained twice
        acc = out["accounting"][stage]
        assert acc["dropped"] == 0
        assert acc["generated"] == acc["trained"] + acc["unconsumed"] + acc["stale"]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train_recs = [r for r in records if r.get("kind") == "train" and r["stage"] != "sft"]
    assert len(train_recs) == 5
    for r in train_recs:           # every step reports its sessions' forks (0 or more)
        assert r["trajectory_forks"] >= 0 and r["branches_trained"] == r["trajectory_forks"]
