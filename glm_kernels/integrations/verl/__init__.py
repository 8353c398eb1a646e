"""verl plug-in: IcePop (``icepop.py``) and ``glm_<name>`` for every verl policy loss
(``losses.py``), registered in verl's own policy-loss registry; verl's rollout-correction
weights and metrics on the fused ops (``rollout_correction.py``).

Importing this package, when verl is installed, registers every loss: it is the module verl's
``verl.plugins`` entry point and ``VERL_USE_EXTERNAL_MODULES`` name (docs/verl.md).
"""
from .icepop import (AGG_MODES, DEFAULT_GATE, INSTALL_HINT, LOSS_NAME, POLICY_LOSSES,
                     VERL_LOSS_NAMES, gate_bounds, icepop_policy_loss, register, register_all)
from .losses import PREFIX
from .rollout_correction import field, rollout_correction

__all__ = ["icepop_policy_loss", "register", "register_all", "gate_bounds", "LOSS_NAME",
           "INSTALL_HINT", "POLICY_LOSSES", "VERL_LOSS_NAMES", "AGG_MODES", "DEFAULT_GATE",
           "PREFIX", "field", "rollout_correction"]
