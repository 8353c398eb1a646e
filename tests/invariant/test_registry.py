"""How the whole-model override reaches aten ops (kernels registered on ADInplaceOrView while a
thread is inside batch_invariant()): what torch's own kernel on that key did (version counters)
still happens, other threads keep torch's kernels, inference_mode is answered or reported,
fake tensors and compiled graphs pass, and a failed registration leaves nothing behind."""
import logging
import threading
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import glm_kernels
from glm_kernels.invariant import _reference as ref
from glm_kernels.invariant import mode_active
from glm_kernels.invariant.mode import REGISTRATION
from glm_kernels.testing import assert_bits_equal

torch.manual_seed(0)


def _operands():
    # One row against a transposed weight (x @ W^T, as nn.Linear): torch's M = 1 kernel
    # differs from the row tile's bits here.
    a, w = torch.randn(1, 32), torch.randn(48, 32).t()
    assert not torch.equal(a @ w, ref.mm(a, w)), "the check below could not fail"
    return a, w


def test_in_place_and_out_ops_still_bump_version_counters():
    """silu_ and mm(out=) are answered here instead of by torch's ADInplaceOrView kernels,
    which bump the written tensor's version: autograd's check on a saved tensor changed in
    place must still fire, and torch's kernels come back on exit."""
    x = torch.randn(6, requires_grad=True)
    a, w = _operands()
    with glm_kernels.batch_invariant():
        y = torch.sigmoid(x)                         # saves its output for the backward
        with torch.no_grad():
            torch.nn.functional.silu(y, inplace=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        out = torch.empty(1, 48)
        version = out._version
        torch.mm(a, w, out=out)
        assert out._version == version + 1
        assert_bits_equal(out, ref.mm(a, w), name="mm out=")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.out", "ADInplaceOrView")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "ADInplaceOrView")
    version = out._version
    torch.mm(a, w, out=out)
    assert out._version == version + 1 and torch.equal(out, a @ w)


def test_other_threads_keep_torchs_kernels_while_one_is_inside():
    a, w = _operands()
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def hold():
        with glm_kernels.batch_invariant():
            seen["holder"] = a @ w
            inside.set()
            done.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(60)
    try:
        assert REGISTRATION.holders == 1 and not mode_active()
        assert_bits_equal(a @ w, a.clone() @ w.clone(), name="sanity")
        other = a @ w
    finally:
        done.set()
        holder.join(60)
    assert torch.equal(other, torch.mm(a, w)) and not torch.equal(other, ref.mm(a, w))
    assert_bits_equal(seen["holder"], ref.mm(a, w), name="the holder's thread")
    assert REGISTRATION.holders == 0


def test_inference_mode(caplog):
    """Entered inside inference_mode (tensors the registered kernels never see): answered by
    the dispatch mode. inference_mode entered inside the block: reported once by name."""
    a, w = _operands()
    with torch.inference_mode():
        x = a.clone()
        with glm_kernels.batch_invariant():
            assert REGISTRATION.holders == 0 and mode_active()
            assert_bits_equal(x @ w.clone(), ref.mm(a, w), name="inference tensors")
    glm_kernels._dispatch._warned.discard("batch_invariant:inference_mode")
    with caplog.at_level(logging.WARNING, logger="glm_kernels"):
        with glm_kernels.batch_invariant():
            with torch.inference_mode():
                torch.mm(torch.randn(2, 32), w)          # the weight has the key: seen here
    assert any("inference_mode" in r.getMessage() for r in caplog.records)


def test_fake_tensors_pass_and_compiled_matmuls_are_answered(caplog):
    """Tracing (fake tensors) goes to torch, logged once (what Inductor generates itself is not
    covered); the graph Inductor compiles calls mm(out=), which is answered like mm."""
    a, w = _operands()
    glm_kernels._dispatch._warned.discard("batch_invariant:traced")
    with caplog.at_level(logging.WARNING, logger="glm_kernels"):
        with glm_kernels.batch_invariant():
            with FakeTensorMode():
                assert torch.mm(torch.empty(3, 32), torch.empty(32, 48)).shape == (3, 48)
            compiled = torch.compile(lambda x, y: x @ y, fullgraph=True, backend="inductor")
            out = compiled(a, w)
    assert_bits_equal(out, ref.mm(a, w), name="compiled mm")
    assert sum("was traced" in r.getMessage() for r in caplog.records) == 1


class _Tagged(torch.Tensor):
    """A subclass with its own __torch_function__ only (no Python dispatch): real data."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclasses_with_real_data_are_answered():
    a, w = _operands()
    with glm_kernels.batch_invariant():
        tagged = a.as_subclass(_Tagged) @ w
    assert_bits_equal(tagged.as_subclass(torch.Tensor), ref.mm(a, w), name="subclass")


def test_a_failed_registration_leaves_nothing(monkeypatch):
    # The second op's schema cannot be read: registering it fails after mm's succeeded.
    broken = types.SimpleNamespace(namespace="aten", _overloadname="default",
                                   _schema=types.SimpleNamespace(name="aten::_glm_broken"))
    monkeypatch.setattr(REGISTRATION, "_ops", lambda: [torch.ops.aten.mm.default, broken])
    with pytest.raises(AttributeError):
        with glm_kernels.batch_invariant():
            pass
    assert REGISTRATION.holders == 0 and not mode_active()
    assert not glm_kernels.batch_invariant_enabled()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "ADInplaceOrView")


def test_whole_model_inside_inference_mode_is_bitwise_on_policy():
    """A rollout engine that samples under inference_mode: the dispatch mode answers there
    (composite ops such as matmul reach it whole and are decomposed), same bits as no_grad."""
    pytest.importorskip("transformers")
    from glm_kernels.testing import assert_batch_invariant, tiny_causal_lm
    model = tiny_causal_lm("qwen3")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 96, (n,), generator=g) for n in (3, 7)]
    with torch.inference_mode(), glm_kernels.batch_invariant():
        report = assert_batch_invariant(model, prompts, max_new_tokens=3)
    assert (report["alone"], report["batch"], report["shuffled"]) == (0, 0, 0)
    with glm_kernels.batch_invariant():
        again = assert_batch_invariant(model, prompts, max_new_tokens=3)
    assert torch.equal(report["rollout"], again["rollout"])
