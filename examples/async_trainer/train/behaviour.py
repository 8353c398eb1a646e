"""Batch-invariant mode, trainer side: the log-probs of the weights that sampled each token.

The trainer is asynchronous: a sample was generated with weight version v while the trainer
already holds v + 1 or later, so its current log-probs differ from the rollout's by the
update, not only by rounding. ``BehaviourPolicy`` keeps the weights of every version it
published (``remember``) and recomputes each sample's log-probs with its own version's
weights inside ``glm_kernels.batch_invariant()`` (``annotate``): bitwise the rollout's, which is what
``logprob_max_abs_diff`` checks every step. The loss then runs IcePop in decoupled mode
(``batch.invariant_icepop_loss``): the gate compares these with the rollout's (ratio exactly
1, nothing popped) and the policy ratio is current / behaviour, PPO's ratio.
"""
from collections import OrderedDict
from typing import Dict, List

import torch

from glm_kernels import batch_invariant, selective_logprobs

from ..model import policy
from .batch import BEHAVIOUR_KEY, collate, routing


class BehaviourPolicy:
    """The published weights of the last ``keep`` versions (CPU copies: this is a CPU mode)
    and the recompute. ``chunk``: sequences per recompute forward (any value gives the same
    bits: that is the point of the mode)."""

    def __init__(self, cfg, keep: int = 32, chunk: int = 64):
        self.cfg, self.keep, self.chunk = cfg, keep, chunk
        self.snapshots: "OrderedDict[int, Dict[str, torch.Tensor]]" = OrderedDict()
        self.model = policy.new_policy(cfg).eval().requires_grad_(False)
        self.loaded = None

    def remember(self, version: int, model) -> None:
        """The weights just published as ``version`` (call after every publish)."""
        self.snapshots[version] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.snapshots.move_to_end(version)
        while len(self.snapshots) > self.keep:
            self.snapshots.popitem(last=False)

    def _load(self, version: int):
        if version not in self.snapshots:
            raise RuntimeError(f"batch-invariant mode: no weights of version {version} kept "
                               f"(kept: {list(self.snapshots)}); a sample is more than "
                               f"{self.keep} versions stale")
        if self.loaded != version:
            self.model.load_state_dict(self.snapshots[version])
            self.loaded = version
        return self.model

    @torch.no_grad()
    def annotate(self, samples: List[dict]) -> None:
        """Set ``BEHAVIOUR_KEY`` on every sample and on the branches it carries (ToRA drift),
        from a batch-invariant forward with the weights of the sample's ``version`` (its
        recorded routing replayed as in training)."""
        by_version: Dict[int, List[dict]] = {}
        for s in samples:
            by_version.setdefault(s["version"], []).extend([s, *s.get("branches", ())])
        for version, seqs in sorted(by_version.items()):
            model = self._load(version)
            for i in range(0, len(seqs), self.chunk):
                part = seqs[i:i + self.chunk]
                batch = collate(part, policy.device_of(model))
                with batch_invariant(), routing(self.cfg, model, part, batch):
                    lp = selective_logprobs(policy.logits(model, batch.inputs),
                                            batch.targets)
                for b, s in enumerate(part):
                    s[BEHAVIOUR_KEY] = lp[b, s["prompt_len"] - 1:len(s["tokens"]) - 1].tolist()
