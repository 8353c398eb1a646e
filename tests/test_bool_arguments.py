"""Every public boolean argument takes ``bool`` only (issue 25): ``"no"`` is truthy and used to
pick the True branch silently, ``numpy.bool_`` and ``1`` slipped through the same way.
One sweep over the public API; each refusal is a TypeError naming the argument."""
import numpy as np
import pytest
import torch

import glm_kernels
from glm_kernels import sync
from glm_kernels.delta import encode
from glm_kernels.muon.split import mla_head_splits
from glm_kernels.optim import MuonSplit, muon_param_groups
from glm_kernels.topk import make_topk_config, moe_route, topk

NOT_BOOLS = ["no", np.bool_(True), 1, None]


def _calls():
    x = torch.randn(4, 9)
    logits = torch.randn(5, 8)
    new, old = torch.ones(10), torch.zeros(10)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    return {
        "largest": lambda v: topk(x, 3, largest=v),
        "sorted": lambda v: topk(x, 3, sorted=v),
        "interpret": lambda v: make_topk_config(9, 3, 4, torch.float32, interpret=v),
        "renormalize": lambda v: moe_route(logits, 2, renormalize=v),
        "return_mismatch": lambda v: moe_route(logits, 2, replay_ids=torch.tensor(
            [[0, 1]] * 5), return_mismatch=v),
        "nesterov": lambda v: MuonSplit([model[0].weight], lr=0.1, nesterov=v),
        "use_muon": lambda v: MuonSplit([{"params": [model[0].weight], "use_muon": v}],
                                        lr=0.1),
        "decay_vectors": lambda v: muon_param_groups(model, decay_vectors=v),
        "split_rope": lambda v: mla_head_splits(2, 4, 2, 4, split_rope=v),
        "relative": lambda v: encode(new, old, encoding="gap16", relative=v),
        "delta": lambda v: sync.Sender(sync.LocalTransport(), delta=v),
        "full": lambda v: sync.Sender(sync.LocalTransport()).publish({"w": new}, full=v),
        "return_metrics": lambda v: glm_kernels.icepop_loss(
            torch.zeros(3), torch.zeros(3), torch.ones(3), return_metrics=v),
        "warn_on_nonfinite": lambda v: glm_kernels.icepop_loss(
            torch.zeros(3), torch.zeros(3), torch.ones(3), warn_on_nonfinite=v),
        "return_entropy": lambda v: glm_kernels.selective_logprobs(
            logits, torch.zeros(5, dtype=torch.int64), return_entropy=v),
    }


@pytest.mark.parametrize("value", NOT_BOOLS, ids=["str", "numpy.bool_", "int", "None"])
@pytest.mark.parametrize("name", sorted(_calls()))
def test_non_bool_flag_refused_naming_it(name, value):
    with pytest.raises(TypeError, match=name):
        _calls()[name](value)


@pytest.mark.parametrize("name", sorted(_calls()))
def test_real_bools_still_accepted(name):
    call = _calls()[name]
    for value in (True, False):
        if name == "return_mismatch" and value is False:
            continue                        # needs no replay_ids then; covered by moe tests
        call(value)


def test_sender_refusing_full_leaves_the_version_unspent():
    sender = sync.Sender(sync.LocalTransport())
    with pytest.raises(TypeError, match="full"):
        sender.publish({"w": torch.zeros(3)}, full="no")
    assert sender.version == 0 and sender.publish({"w": torch.zeros(3)}) == 1
