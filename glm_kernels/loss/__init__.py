"""Policy losses and advantages for GRPO + IcePop and on-policy distillation."""
from .advantages.advantages import group_advantages, opd_advantages
from .icepop.from_logits import icepop_loss_from_logits
from .icepop.fused_linear import fused_linear_icepop_loss
from .icepop.icepop import icepop_loss
from .kl.kl_penalty import kl_penalty_loss, kl_penalty_terms
from .logprobs.linear import fused_linear_logprobs
from .mismatch.mismatch import MISMATCH_KEYS, mismatch_metrics
from .policy.policy import POLICY_VARIANTS, PolicyLossSpec, policy_loss
from .policy.selection import clip_cov_selection, kl_cov_selection
from .policy.sequence_is import sequence_is_weights
from .logprobs.logprobs import selective_logprobs
from .reverse_kl.reverse_kl import reverse_kl_from_logits

__all__ = ["icepop_loss", "group_advantages", "opd_advantages", "selective_logprobs",
           "icepop_loss_from_logits", "fused_linear_icepop_loss", "fused_linear_logprobs",
           "reverse_kl_from_logits",
           "mismatch_metrics", "MISMATCH_KEYS", "policy_loss", "PolicyLossSpec",
           "POLICY_VARIANTS", "kl_penalty_loss", "kl_penalty_terms", "clip_cov_selection",
           "kl_cov_selection", "sequence_is_weights"]
