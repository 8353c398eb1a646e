"""glm_kernels: fused kernels for GLM-5-style RL post-training.

Public API (see README.md and docs/design.md):
    losses      policy_loss (every verl / TRL policy loss; PolicyLossSpec, POLICY_VARIANTS),
                icepop_loss, icepop_loss_from_logits, fused_linear_icepop_loss,
                selective_logprobs, fused_linear_logprobs (log-probs and entropy from hidden
                states), reverse_kl_from_logits, group_advantages, opd_advantages,
                kl_penalty_loss, kl_penalty_terms (verl's reference-KL loss; TRL's per-token KL),
                mismatch_metrics (train-inference mismatch: k1, k3, chi2, log-ppl gap)
    Muon Split  newton_schulz, HeadSplit, muon_split_orthogonalize; glm_kernels.optim
    top-k       topk, moe_route (replay_ids=, return_mismatch=: rollout routing replay);
                glm_kernels.topk: routing_mismatch, encode_routing, decode_routing
    weight sync glm_kernels.delta (codec), glm_kernels.sync (transports)
Batch invariance: ``with glm_kernels.batch_invariant(): ...`` (or GLM_KERNELS_BATCH_INVARIANT=1).
Backends: ``glm_kernels.force_backend("torch"|"triton"|"interpret")`` or the environment
variable ``GLM_KERNELS_BACKEND``.
"""
from . import _dispatch  # first: sets TRITON_INTERPRET before any kernel module is imported
from . import delta, optim, sync
from ._dispatch import batch_invariant_enabled, force_backend, select_backend
from .loss import (POLICY_VARIANTS, PolicyLossSpec, fused_linear_icepop_loss,
                   fused_linear_logprobs, group_advantages, icepop_loss, icepop_loss_from_logits,
                   kl_penalty_loss, kl_penalty_terms, mismatch_metrics, opd_advantages,
                   policy_loss, reverse_kl_from_logits, selective_logprobs)
from .muon import HeadSplit, muon_split_orthogonalize, newton_schulz
# After this line ``glm_kernels.topk`` is the function; the subpackage stays importable as
# ``glm_kernels.topk.<module>`` (``from glm_kernels.topk import moe_route`` works too).
from .topk import moe_route, topk
from .invariant import batch_invariant  # GLM_KERNELS_BATCH_INVARIANT=1 enters its override

__version__ = "0.1.0"
__all__ = ["icepop_loss", "icepop_loss_from_logits", "fused_linear_icepop_loss",
           "fused_linear_logprobs", "kl_penalty_loss", "kl_penalty_terms",
           "selective_logprobs", "reverse_kl_from_logits", "mismatch_metrics", "group_advantages",
           "opd_advantages", "policy_loss", "PolicyLossSpec", "POLICY_VARIANTS",
           "newton_schulz", "HeadSplit", "muon_split_orthogonalize",
           "optim", "topk", "moe_route", "delta", "sync", "force_backend",
           "batch_invariant", "batch_invariant_enabled", "select_backend",
           "__version__"]
