"""Backend selection and the logged fallback."""
import logging

import pytest
import torch

import glm_kernels
from glm_kernels import _checks, _dispatch


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
        _checks.check_tensor("weights", [1, 2])
    with pytest.raises(ValueError, match="x must have 2 dims"):
        _checks.check_tensor("x", torch.zeros(3), ndim=(2,))
    with pytest.raises(ValueError, match="lr must be > 0"):
        _checks.check_finite_number("lr", 0.0, positive=True)


@pytest.fixture
def fake_versions(monkeypatch):
    """Pretend other Triton / numpy versions are installed (the reasons are cached per process)."""
    triton = pytest.importorskip("triton")
    import numpy

    def use(triton_version, numpy_version):
        monkeypatch.setattr(triton, "__version__", triton_version)
        monkeypatch.setattr(numpy, "__version__", numpy_version)
        _dispatch.triton_unavailable_reason.cache_clear()
        _dispatch.interpreter_unavailable_reason.cache_clear()
    yield use
    monkeypatch.undo()
    _dispatch.triton_unavailable_reason.cache_clear()
    _dispatch.interpreter_unavailable_reason.cache_clear()


def test_triton_older_than_floor_is_unavailable_with_reason(fake_versions):
    fake_versions("3.3.1", "2.2.6")
    assert not _dispatch.triton_available()
    assert "3.3.1 is older than 3.4" in _dispatch.triton_unavailable_reason()
    fake_versions("3.4.0+git1234", "2.2.6")
    assert _dispatch.triton_available()
    assert _dispatch.interpreter_unavailable_reason() is None


@pytest.mark.parametrize("requires, advice", [
    # a CUDA torch on Linux pins its Triton: only a newer torch brings a newer one
    (["filelock", "triton==3.3.1; platform_system == 'Linux'"],
     "pins triton 3.3.1: pip install 'torch>=2.8', which brings a Triton >= 3.4"),
    (["triton==3.4.0 ; platform_system == 'Linux'"], "pip install 'triton==3.4.0', the Triton"),
    (["filelock", "sympy"], "pip install 'triton>=3.4'"),     # a CPU torch pins none
])
def test_install_advice_fits_the_installed_torch(monkeypatch, requires, advice):
    import importlib.metadata
    real = importlib.metadata.requires
    monkeypatch.setattr(importlib.metadata, "requires",
                        lambda name: requires if name == "torch" else real(name))
    assert advice in _dispatch._triton_install_advice()


def test_interpreter_numpy_clash_is_named(fake_versions, monkeypatch):
    fake_versions("3.6.0", "2.3.1")
    assert _dispatch.triton_available()            # compiled kernels are unaffected
    assert "numpy<2.3" in _dispatch.interpreter_unavailable_reason()
    monkeypatch.setattr(_dispatch, "interpreter_active", lambda: True)
    with glm_kernels.force_backend("interpret"):
        with pytest.raises(RuntimeError, match="numpy 2.3.1"):
            _dispatch.select_backend("demo_op", torch.zeros(2))
    fake_versions("3.7.0", "2.4.0")
    assert _dispatch.interpreter_unavailable_reason() is None
