"""``--resume`` validates every field of the checkpoint before anything of it is applied
(issue 25): step counters, stage names, sample accounting, the shape / dtype / finiteness of
every model and optimizer tensor, the saved config. A refused resume writes nothing -- the
demo resumes from ``runs/demo/checkpoint.pt``, the file it writes -- and a resume that fails
later, before it reached its stage, writes that stage's state back instead of dropping it."""
import copy
import dataclasses
import math

import pytest
import torch

import examples.async_trainer.__main__ as cli
from examples.async_trainer import trainer
from examples.async_trainer.train import checkpoint, recipe
from examples.async_trainer.config import TrainerConfig

TINY = dict(tasks="reverse", sft_steps=2, rl_steps=4, opd_steps=0, prompts_per_step=2,
            group_size=2, eval_prompts=4, progress=False, rollout_backend="process")
STAGE = "rl:reverse"


def _valid_state(out_dir):
    """An in-stage checkpoint as the trainer writes one: sft finished (no eval record yet),
    rl:reverse at step 1 with a MuonSplit state after one step."""
    cfg = TrainerConfig(**TINY, out_dir=str(out_dir)).validate()
    torch.manual_seed(0)
    model = recipe.new_model(cfg)
    opt = recipe.stage_optimizer(cfg, STAGE, model)             # what rl stages train with
    sum((p.float() ** 2).sum() for p in model.parameters()).backward()
    opt.step()
    return {"config": dataclasses.asdict(cfg), "records": [], "trained": {STAGE: ["0.0", "0.1"]},
            "accounting": {STAGE: {"generated": 4, "trained": 2, "unconsumed": 0,
                                   "dropped": 0}},
            "finished": {"sft": checkpoint.tensors(recipe.new_model(cfg).state_dict())},
            "global_step": 3, "rollout_procs": 1, "stage": STAGE, "step": 1,
            "model": checkpoint.tensors(model.state_dict()), "optimizer": opt.state_dict()}


def _first_float(tensors):
    return next(k for k, v in tensors.items() if v.is_floating_point() and v.numel())


def _opt_tensor(state):
    """(param index, key) of a non-scalar tensor in the optimizer state."""
    for index, per_param in state["optimizer"]["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dim():
                return index, key
    raise AssertionError("no optimizer state tensor")


def _nan_model(s):
    s["model"][_first_float(s["model"])].view(-1)[0] = math.nan


def _wrong_shape(s):
    name = _first_float(s["model"])
    s["model"][name] = torch.zeros(tuple(d + 1 for d in s["model"][name].shape))


def _missing(s):
    del s["model"][_first_float(s["model"])]


def _nan_finished(s):
    s["finished"]["sft"][_first_float(s["finished"]["sft"])].view(-1)[-1] = math.inf


def _nan_optimizer(s):
    index, key = _opt_tensor(s)
    s["optimizer"]["state"][index][key].view(-1)[0] = math.nan


def _opt_wrong_shape(s):
    index, key = _opt_tensor(s)
    s["optimizer"]["state"][index][key] = torch.zeros(7, 3)


def _opt_extra_group(s):
    s["optimizer"]["param_groups"].append(dict(s["optimizer"]["param_groups"][0], params=[999]))


def _set(key, value):
    def edit(s):
        s[key] = value
    return edit


def _set_in(*path_and_value):
    *path, value = path_and_value

    def edit(s):
        d = s
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = value
    return edit


CASES = {
    "negative global_step": (_set("global_step", -1), r"global_step must be an int in \[0"),
    "bool global_step": (_set("global_step", True), "global_step"),
    "negative rollout_procs": (_set("rollout_procs", -3), "rollout_procs"),
    "negative step": (_set("step", -1), r"step must be an int in \[0, 4\]"),
    "step past the stage": (_set("step", 10 ** 6), r"step must be an int in \[0, 4\]"),
    "unknown stage": (_set("stage", "rl:nope"), "stage"),
    "stage already finished": (_set("stage", "sft"), "also in finished"),
    "NaN weight": (_nan_model, r"model\[.*non-finite"),
    "wrong-shape weight": (_wrong_shape, r"model\[.*has shape"),
    "missing weight": (_missing, r"model does not match the model: missing"),
    "inf in a finished stage": (_nan_finished, r"finished\['sft'\]\[.*non-finite"),
    "NaN optimizer state": (_nan_optimizer, r"optimizer.*non-finite"),
    "wrong-shape optimizer state": (_opt_wrong_shape, r"optimizer.*has shape \(7, 3\)"),
    "extra optimizer group": (_opt_extra_group, r"optimizer does not fit"),
    "negative accounting": (_set_in("accounting", STAGE, "dropped", -1), "accounting"),
    "int sample ids": (_set_in("trained", STAGE, [1, 2]), r"trained\['rl:reverse'\]"),
    "config type": (_set_in("config", "rl_steps", "4"), r"config\.rl_steps must be int"),
    "config range": (_set_in("config", "sft_steps", -1), r"config\.sft_steps must be >= 0"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_checkpoint_refused_naming_the_field_and_left_untouched(tmp_path, case):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    state = _valid_state(out_dir)
    edit, match = CASES[case]
    edit(state)
    path = out_dir / "checkpoint.pt"               # the demo resumes from where it writes
    checkpoint.save(str(path), state)
    before = path.read_bytes()
    with pytest.raises(checkpoint.CheckpointError, match=match):
        trainer.train(TrainerConfig(resume=str(path), out_dir=str(out_dir), progress=False))
    assert path.read_bytes() == before
    assert sorted(p.name for p in out_dir.iterdir()) == ["checkpoint.pt"]   # nothing written


def test_cli_exit_2_for_a_refused_resume(tmp_path, capsys):
    state = _valid_state(tmp_path)
    _nan_model(state)
    checkpoint.save(str(tmp_path / "checkpoint.pt"), state)
    assert cli.main(["--resume", str(tmp_path / "checkpoint.pt"), "--out-dir",
                     str(tmp_path), "--progress", "false"]) == 2
    err = capsys.readouterr().err
    assert "config.resume" in err and "non-finite" in err, err


def test_a_resume_that_fails_before_its_stage_keeps_the_stage_state(tmp_path, monkeypatch):
    """The valid checkpoint passes validation; the run evaluates the finished sft stage
    (writing a checkpoint), then fails before rl:reverse resumed: every checkpoint written
    on the way still holds rl:reverse's step, weights and optimizer state."""
    state = _valid_state(tmp_path)
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(str(path), copy.deepcopy(state))

    def boom(*args, **kwargs):
        raise RuntimeError("rl stage failed to start")
    monkeypatch.setattr(trainer, "rl_stage", boom)
    with pytest.raises(RuntimeError, match="failed to start"):
        trainer.train(TrainerConfig(resume=str(path), out_dir=str(tmp_path), progress=False))
    saved = checkpoint.load(str(path))
    assert (saved["stage"], saved["step"]) == (STAGE, 1)
    assert any(r.get("kind") == "eval" and r["stage"] == "sft" for r in saved["records"])
    assert saved["model"].keys() == state["model"].keys()
    assert all(torch.equal(saved["model"][k], v) for k, v in state["model"].items())
    index, key = _opt_tensor(state)
    assert torch.equal(saved["optimizer"]["state"][index][key],
                       state["optimizer"]["state"][index][key])
