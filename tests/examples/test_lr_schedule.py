"""The example's learning-rate schedule of each RL / OPD stage (``policy.schedule_lr``): each
param group scaled from its own starting rate, warm-up then constant / linear / cosine decay to
``lr_min_ratio`` times it at the stage's last step, never compounding over calls; and the
config's errors naming the field."""
import math

import pytest
import torch

from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.model import policy


def _optimizer():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    return torch.optim.SGD([{"params": [a], "lr": 0.5}, {"params": [b], "lr": 0.002}])


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_every_group_follows_the_schedule_from_its_own_rate(schedule):
    cfg = TrainerConfig(lr_schedule=schedule, lr_min_ratio=0.1, lr_warmup_steps=2).validate()
    opt, steps = _optimizer(), 12
    factors = [policy.schedule_lr(opt, cfg, step, steps) for step in range(steps)]
    assert factors[:2] == [1 / 3, 2 / 3]                              # warm-up
    for group, base in zip(opt.param_groups, (0.5, 0.002)):
        assert group["base_lr"] == base and group["lr"] == pytest.approx(base * factors[-1])
    decay = factors[2:]
    if schedule == "constant":
        assert decay == [1.0] * 10
        return
    assert decay[0] == 1.0 and decay[-1] == pytest.approx(0.1)
    assert all(x > y for x, y in zip(decay, decay[1:]))               # strictly down
    t = 4 / 9                                  # step 6: 4 of the 9 decay intervals
    want = 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi * t)) if schedule == "cosine" else 1 - t)
    assert decay[4] == pytest.approx(want)


def test_a_resumed_stage_continues_the_schedule():
    """The rates are set from ``base_lr`` at every step: an optimizer whose state was saved
    mid-stage (decayed rate, base_lr kept) gives the same rate as one that never stopped."""
    cfg = TrainerConfig(lr_schedule="linear").validate()
    running = _optimizer()
    for step in range(6):
        policy.schedule_lr(running, cfg, step, 10)
    resumed = _optimizer()
    resumed.load_state_dict(running.state_dict())
    assert policy.schedule_lr(resumed, cfg, 6, 10) == policy.schedule_lr(running, cfg, 6, 10)
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in running.param_groups]


@pytest.mark.parametrize("field, value", [("lr_schedule", "step"), ("lr_min_ratio", 1.5),
                                          ("lr_min_ratio", -0.1), ("lr_warmup_steps", -1)])
def test_bad_schedule_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"config.{field}"):
        TrainerConfig(**{field: value}).validate()
