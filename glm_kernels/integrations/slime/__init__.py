"""slime plug-ins, each named on a slime command line by its dotted path.

* ``icepop.py`` -- ``icepop_loss_function`` (``--custom-loss-function-path``),
  ``icepop_tis_function`` (``--custom-tis-function-path``) and ``opd_log_ratio_advantages``
  (``--custom-reward-post-process-path``), re-exported here: the paths
  ``glm_kernels.integrations.slime.<name>`` are the ones the docs and recipes give.
* ``policy.py`` -- slime's policy loss with every option slime ships, on
  ``glm_kernels.policy_loss`` (``policy_loss_function``, ``mis_tis_function``), also reachable
  as ``glm_kernels.integrations.slime_policy``.
* ``delta.py`` -- ``install`` for ``--custom-megatron-init-path`` (GPU-side delta weight
  updates), also reachable as ``glm_kernels.integrations.slime_delta``.

Importing this package imports neither slime nor Megatron.
"""
from .icepop import (icepop_gate_weights, icepop_loss_function, icepop_tis_function,
                     opd_log_ratio_advantages)

__all__ = ["icepop_loss_function", "icepop_tis_function", "opd_log_ratio_advantages",
           "icepop_gate_weights"]
