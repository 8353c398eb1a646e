"""GRPO group advantages and OPD advantages against hand-computed values."""
import math

import pytest
import torch

from glm_kernels import group_advantages, opd_advantages


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 3, eps=0.0)
    # group 0: mean 1/3, unbiased std sqrt(1/3)
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    expected = [(1 - mean) / std, -mean / std, -mean / std]
    assert adv[:3].tolist() == pytest.approx(expected, rel=1e-5)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]      # flat group


def test_group_advantages_matches_torch_std():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(8 * 32, generator=gen)
    adv = group_advantages(rewards, 32)
    grouped = rewards.view(8, 32)
    expected = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    assert torch.allclose(adv, expected.view(-1), rtol=1e-5, atol=1e-6)


def test_group_advantages_binary_and_group_of_one():
    assert group_advantages(torch.tensor([True, False]), 2).dtype == torch.float32
    assert group_advantages(torch.tensor([0.3, 0.7]), 1).tolist() == [0.0, 0.0]
    assert group_advantages(torch.zeros(0), 4).shape == (0,)


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(TypeError, match="rewards"):
        group_advantages([1.0, 0.0], 2)


def test_opd_forms():
    student = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0]])
    log_ratio = opd_advantages(student, teacher, form="log_ratio")
    assert log_ratio.tolist() == [[0.5, -1.0]] and not log_ratio.requires_grad
    outcome = torch.tensor([2.0])
    kl = opd_advantages(student, teacher, form="kl_penalty", advantages=outcome, coef=0.5)
    assert kl.tolist() == [[2.0 - 0.5 * -0.5, 2.0 - 0.5 * 1.0]]


def test_opd_bad_input():
    s = torch.zeros(3)
    with pytest.raises(ValueError, match="form"):
        opd_advantages(s, s, form="reverse")
    with pytest.raises(ValueError, match="needs advantages"):
        opd_advantages(s, s, form="kl_penalty")
    with pytest.raises(ValueError, match="teacher_logprobs"):
        opd_advantages(s, torch.zeros(4), form="log_ratio")
    with pytest.raises(ValueError, match="only used"):
        opd_advantages(s, s, form="log_ratio", advantages=s)


def test_docstring_examples():
    """The runnable examples in the public docstrings stay true."""
    import doctest
    from glm_kernels.loss.advantages import advantages
    from glm_kernels.loss.icepop import icepop
    for module in (advantages, icepop):
        failures, attempted = doctest.testmod(module, extraglobs={"torch": torch},
                                              optionflags=doctest.ELLIPSIS)
        assert attempted > 0 and failures == 0, module.__name__
