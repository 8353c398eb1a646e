"""Turn ``Sample`` dicts into padded training tensors, and the policy-gradient step."""
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from glm_kernels import batch_invariant, icepop_loss, selective_logprobs
from glm_kernels.loss import fused_linear_icepop_loss

from ..env import task
from ..model import policy
from .packing import assign_to_ranks


@dataclass
class Batch:
    """Right-padded micro-batch. Position t of the [B, L-1] tensors predicts ``tokens[:, t+1]``."""
    tokens: torch.Tensor            # [B, L] int64
    rollout_logprobs: torch.Tensor  # [B, L-1] fp32, 0 outside policy-sampled positions
    loss_mask: torch.Tensor         # [B, L-1] fp32, 1 on policy tokens only

    @property
    def inputs(self):
        return self.tokens[:, :-1]

    @property
    def targets(self):
        return self.tokens[:, 1:]


def place(samples: List[dict], key: str, width: int, device) -> torch.Tensor:
    """[B, width] fp32 with each sample's per-response-position ``key`` at its positions."""
    out = torch.zeros(len(samples), width, dtype=torch.float32)
    for b, s in enumerate(samples):
        p, n = s["prompt_len"], len(s["tokens"])
        out[b, p - 1:n - 1] = torch.as_tensor(s[key], dtype=torch.float32)
    return out.to(device)


def collate(samples: List[dict], device) -> Batch:
    width = max(len(s["tokens"]) for s in samples)
    tokens = torch.full((len(samples), width), task.PAD, dtype=torch.long)
    for b, s in enumerate(samples):
        tokens[b, :len(s["tokens"])] = torch.as_tensor(s["tokens"])
    return Batch(tokens.to(device), place(samples, "rollout_logprobs", width - 1, device),
                 place(samples, "loss_mask", width - 1, device))


def sft_sample(cfg, prompt: List[int]) -> dict:
    """The passing trajectory of ``prompt`` as a sample (loss on assistant tokens only)."""
    tokens = prompt + task.expected_completion(cfg, prompt)
    mask = task.template_loss_mask(tokens, len(prompt))[len(prompt):]
    return {"tokens": tokens, "prompt_len": len(prompt), "loss_mask": mask,
            "rollout_logprobs": [0.0] * len(mask)}


def training_sequences(samples: List[dict]) -> List[dict]:
    """Every sequence the step trains on: each sample, then the branches its session closed on
    a re-tokenization drift (ToRA, ``rollout/trajectory.py``), which train with their sample's
    advantage and task (``origin``: the sample's ``id``)."""
    out = []
    for s in samples:
        out.append(s)
        out += [dict(b, task=s["task"], origin=id(s)) for b in s.get("branches", ())]
    return out


def real_positions(samples: List[dict], batch: Batch, whole: bool = False) -> torch.Tensor:
    """bool [B, L-1] (``whole``: [B, L]): the positions of ``batch.inputs`` (``whole``:
    ``batch.tokens``) that hold a sample's tokens, not right padding."""
    tokens = batch.tokens if whole else batch.inputs
    lengths = torch.tensor([len(s["tokens"]) - (not whole) for s in samples],
                           device=tokens.device)
    return torch.arange(tokens.shape[1], device=lengths.device) < lengths[:, None]


def routing(cfg, model, samples: List[dict], batch: Batch):
    """The routing context of the policy's forward over a micro-batch: the rollout's recorded
    routing replayed when ``cfg.routing_replay`` (R3), else only compared; the model's own
    when the samples carry none (``policy.train_routing``, yields its ``RoutingStats``)."""
    packets = [s.get("routing") for s in samples]
    if not packets or any(p is None for p in packets):
        packets = None
    return policy.train_routing(model, packets, batch.inputs.shape[1], cfg.routing_replay,
                                real_positions(samples, batch))


def routing_metrics(sums: Dict[str, float]) -> Dict[str, float]:
    """``routing_mismatch``: fraction of (position, MoE layer) pairs whose own routing is
    another expert set than the rollout's (with replay on: the choice the layer did not
    take); empty when the step's samples carried no routing."""
    if not sums.get("route_compared"):
        return {}
    return {"routing_mismatch": sums["route_mismatch"] / sums["route_compared"]}


# loss_fn(model, mb_samples, batch) -> (summed loss, icepop metrics, {extra metric: sum})
LossFn = Callable[[torch.nn.Module, List[dict], Batch], tuple]


def icepop_kwargs(cfg) -> dict:
    return dict(beta=cfg.beta, eps_low=cfg.eps_low, eps_high=cfg.eps_high, reduction="sum",
                return_metrics=True)


# A sample's behaviour log-probs (``train/behaviour.py``), per response position like
# ``rollout_logprobs``; set in batch-invariant mode only.
BEHAVIOUR_KEY = "behaviour_logprobs"

# Extra metrics of a loss_fn that policy_step combines by max over micro-batches (the
# others are summed).
MAX_METRICS = ("logprob_max_abs_diff",)


def logprob_gap(train_logprobs: torch.Tensor, batch: Batch) -> Dict[str, float]:
    """``logprob_max_abs_diff``: max |rollout - train| over the masked-in tokens (0.0 when
    none), ``train`` being the log-probs IcePop's gate compares with the rollout's."""
    gap = torch.where(batch.loss_mask > 0, (batch.rollout_logprobs - train_logprobs).abs(), 0.0)
    return {"logprob_max_abs_diff": float(gap.max()) if gap.numel() else 0.0}


def invariant_icepop_loss(cfg, logits: torch.Tensor, mb_samples: List[dict], batch: Batch,
                          advantages: torch.Tensor) -> tuple:
    """``--batch-invariant``: IcePop in decoupled mode, the gate on the behaviour log-probs
    (``train/behaviour.py``: the weights that sampled each token, recomputed bitwise) against the
    rollout's, the policy ratio exp(current - behaviour); ``logits`` from the invariant
    forward. Returns (summed loss, metrics, {"logprob_max_abs_diff": ...})."""
    old = place(mb_samples, BEHAVIOUR_KEY, batch.loss_mask.shape[1], batch.loss_mask.device)
    with batch_invariant():
        lp = selective_logprobs(logits, batch.targets)
        loss, m = icepop_loss(lp, batch.rollout_logprobs, advantages, batch.loss_mask,
                              old_logprobs=old, **icepop_kwargs(cfg))
    return loss, m, logprob_gap(old, batch)


def fused_linear_grpo_loss(cfg, advantages: torch.Tensor, row_of: Dict[int, int]) -> LossFn:
    """GRPO + IcePop straight from the last hidden states and the lm_head weight
    (``fused_linear_icepop_loss``: the [tokens, vocab] logits are never materialized);
    with ``cfg.batch_invariant`` from the invariant forward (``invariant_icepop_loss``)."""
    def loss_fn(model, mb_samples, batch):
        adv = advantages[[row_of[s.get("origin", id(s))] for s in mb_samples]]   # [B]
        if cfg.batch_invariant:
            with batch_invariant():
                logits = policy.logits(model, batch.inputs)
            return invariant_icepop_loss(cfg, logits, mb_samples, batch, adv)
        hidden = policy.hidden(model, batch.inputs)
        loss, m = fused_linear_icepop_loss(hidden, model.lm_head.weight,
                                           batch.targets, batch.rollout_logprobs, adv,
                                           batch.loss_mask, **icepop_kwargs(cfg))
        with torch.no_grad():      # the gap the gate saw (a [tokens, vocab] fp32 product)
            lp = selective_logprobs(F.linear(hidden, model.lm_head.weight), batch.targets)
        return loss, m, logprob_gap(lp, batch)
    return loss_fn


def policy_step(cfg, model, opt, samples: List[dict], loss_fn: LossFn) -> Dict:
    """One optimizer step over ``samples`` (and their closed branches, ``training_sequences``)
    packed into micro-batches on simulated DP ranks.

    The loss is the global token mean over every rank's masked tokens (slime's token_mean);
    gradients are accumulated over the simulated ranks' micro-batches, as an all-reduce would.
    Samples that carry the rollout's routing have it replayed (``cfg.routing_replay``) or
    compared; ``route_mismatch`` / ``route_compared`` count it (``routing_metrics``). The
    experts' load over the step's forwards moves the balancing bias (``policy``).
    """
    device = next(model.parameters()).device
    samples = training_sequences(samples)
    lengths = [len(s["tokens"]) for s in samples]
    ranks = assign_to_ranks(lengths, cfg.dp_ranks, cfg.max_tokens_per_microbatch, cfg.packing)
    n_tok = max(sum(sum(s["loss_mask"]) for s in samples), 1.0)
    sums: Dict[str, float] = {"pop": 0.0, "clip": 0.0, "tokens": 0.0, "loss": 0.0}
    load = None
    opt.zero_grad(set_to_none=True)
    for micro_batches in ranks:
        for mb in micro_batches:
            if not mb:          # a padding-only micro-batch (equal counts per rank): no loss
                continue
            mb_samples = [samples[i] for i in mb]
            batch = collate(mb_samples, device)
            with routing(cfg, model, mb_samples, batch) as route:
                loss, m, extra = loss_fn(model, mb_samples, batch)
            if route.compared:
                sums["route_mismatch"] = sums.get("route_mismatch", 0.0) + route.mismatched
                sums["route_compared"] = sums.get("route_compared", 0.0) + route.compared
            load = route.load if load is None else load + route.load
            (loss / n_tok).backward()
            masked = float(batch.loss_mask.sum())
            sums["pop"] += float(m["pop_frac"]) * masked
            sums["clip"] += float(m["clip_frac"]) * masked
            sums["tokens"] += masked
            sums["loss"] += float(loss.detach())
            for k, v in extra.items():
                sums[k] = max(sums.get(k, 0.0), v) if k in MAX_METRICS else sums.get(k, 0.0) + v
    opt.step()
    policy.update_balance_bias(model, load, cfg.balance_bias_rate)
    return sums
