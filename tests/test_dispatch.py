"""Backend selection and the logged fallback."""
import logging

import pytest
import torch

import glm_kernels
from glm_kernels import _dispatch


def test_cpu_defaults_to_torch():
    assert _dispatch.select_backend("op", torch.zeros(2)) == "torch"


def test_forced_backends():
    with glm_kernels.force_backend("torch"):
        assert _dispatch.select_backend("op", torch.zeros(2)) == "torch"
    with glm_kernels.force_backend("triton"):
        with pytest.raises(ValueError, match="CUDA tensors"):
            _dispatch.select_backend("op", torch.zeros(2))
    if _dispatch.triton_available() and _dispatch.interpreter_active():
        with glm_kernels.force_backend("interpret"):
            assert _dispatch.select_backend("op", torch.zeros(2), None) == "interpret"
    with pytest.raises(ValueError, match="backend"):
        with glm_kernels.force_backend("fast"):
            pass


def test_fallback_is_logged_once(caplog, monkeypatch):
    class FakeCuda(torch.Tensor):
        pass
    fake = torch.zeros(1).as_subclass(FakeCuda)
    monkeypatch.setattr(FakeCuda, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)
    monkeypatch.setattr(_dispatch, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="glm_kernels"):
        assert _dispatch.select_backend("demo_op", fake) == "torch"
        assert _dispatch.select_backend("demo_op", fake) == "torch"
    messages = [r.message for r in caplog.records if "demo_op" in r.message]
    assert len(messages) == 1 and "torch reference" in messages[0]
    assert "fallback:demo_op" in _dispatch.fallbacks_logged()


def test_validation_messages_name_the_argument():
    with pytest.raises(TypeError, match="weights must be a torch.Tensor"):
        _dispatch.check_tensor("weights", [1, 2])
    with pytest.raises(ValueError, match="x must have 2 dims"):
        _dispatch.check_tensor("x", torch.zeros(3), ndim=(2,))
    with pytest.raises(ValueError, match="lr must be > 0"):
        _dispatch.check_finite_number("lr", 0.0, positive=True)
