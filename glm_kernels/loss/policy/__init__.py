"""The fused policy-loss family: every verl / TRL policy loss, the IcePop gate composable on each.

``policy_loss`` (``policy.py``) with a compile-time :class:`PolicyLossSpec` (``_spec.py``);
Clip-Cov / KL-Cov token selections (``selection.py``); sequence-level IS weights
(``sequence_is.py``). Kernels in ``_kernels.py`` built from the per-tile helpers of
``_tile.py``, the readable definition in ``_reference.py``, the torch backend's lean path in
``_torch.py``.
"""
from ._spec import POLICY_VARIANTS, PolicyLossSpec
from .policy import policy_loss
from .selection import clip_cov_selection, kl_cov_selection
from .sequence_is import sequence_is_weights

__all__ = ["policy_loss", "PolicyLossSpec", "POLICY_VARIANTS", "clip_cov_selection",
           "kl_cov_selection", "sequence_is_weights"]
