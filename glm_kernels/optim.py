"""Optimizers: ``MuonSplit`` (Muon with per-head MLA splits + AdamW) and its param-group router.

    >>> from glm_kernels.optim import MuonSplit, muon_param_groups
    >>> # opt = MuonSplit(muon_param_groups(model, head_splits="glm5"), lr=0.02, adamw_lr=3e-4)
"""
from .muon.optimizer import OUTPUT_HEAD_NAMES, MuonSplit, muon_param_groups
from .muon.sharded import full_state_dict
from .muon.split import HeadSplit, mla_head_splits

__all__ = ["MuonSplit", "muon_param_groups", "HeadSplit", "mla_head_splits",
           "OUTPUT_HEAD_NAMES", "full_state_dict"]
