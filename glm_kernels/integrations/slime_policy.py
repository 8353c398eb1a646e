"""The path slime command lines name (``--custom-loss-function-path
glm_kernels.integrations.slime_policy.policy_loss_function``, ``--custom-tis-function-path
glm_kernels.integrations.slime_policy.mis_tis_function``): the code is
``glm_kernels.integrations.slime.policy``."""
from .slime.policy import SLIME_VARIANTS, mis_tis_function, policy_loss_function

__all__ = ["policy_loss_function", "mis_tis_function", "SLIME_VARIANTS"]
