"""The loss of TRL 1.16's ``GRPOTrainer`` for every loss option of ``GRPOConfig``, computed by
glm_kernels: the trainers of :mod:`glm_kernels.integrations.trl` inherit it.

One forward of the model for the last hidden states (``logits_to_keep=1``: the [B, T, V]
logits never exist), then

* ``fused_linear_logprobs`` -- log pi_theta and the entropy of every completion token from the
  hidden states and the LM head, chunked over the vocabulary, differentiable (the entropy
  bonus has a gradient);
* ``policy_loss`` -- the policy term of the ``loss_type`` (clip family with TRL's ``delta``,
  CISPO, SAPO, VESPO) at the ``importance_sampling_level`` (token, or the sequence ratio
  exp(masked mean log-ratio) with the gradient through the mean), each token's term times
  the detached weights TRL applies: its vLLM importance-sampling ratio (every
  ``vllm_importance_sampling_mode``; VESPO takes it inside phi instead), the off-policy
  sequence mask (``off_policy_mask_threshold``) and the high-entropy mask
  (``top_entropy_quantile``), reduced by policy_loss with the ``loss_type``'s denominator
  and TRL's gradient-accumulation scale; the IcePop gate composes here, as a
  0/1 factor on that IS ratio (:class:`IcePopGRPOTrainer`);
* ``kl_penalty_terms`` -- TRL's ``beta > 0`` reference KL, k3 without clamp,
  exp(ref - lp) - (ref - lp) - 1, times the (token or sequence) ratio with its gradient when
  ``use_bias_correction_kl``,
  reduced like the policy term (TRL adds it per token before the reduction);
* the entropy bonus ``- entropy_coef * token-mean entropy`` (static or TRL's adaptive
  controller).

TRL's helpers are used for what is not the loss: ``get_high_entropy_mask`` (the entropy
quantile across processes) and ``get_off_policy_mask`` (the OPSM keep-mask). Metrics: TRL's
keys with TRL's values (``entropy``, ``kl``, ``clip_ratio/*``, ``cispo_clip_ratio``,
``vespo/phi_seq_mean``, ``policy_loss`` and ``entropy_coef`` with the entropy bonus,
``aux_loss`` for MoE models: their load-balancing loss is added as TRL adds it).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from ...loss import fused_linear_logprobs

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# The [chunk, V] logits chunk of the fused passes: at V = 151,936 the CPU (torch) path's
# default (512 MiB) peaked above TRL's whole step (benchmarks/notes/trl.md).
DEFAULT_MEMORY_BUDGET = 64 << 20


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype active for ``device_type``, or None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):             # torch < 2.4 spellings
        if device_type == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    return None


def check_loss_options(args) -> None:
    """Refuse, at construction, the loss options stock TRL refuses (it does so at the first
    loss, with these messages)."""
    if args.loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss type: {args.loss_type} (loss_type: expected one of "
                         f"{list(LOSS_TYPES)})")
    if args.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"Unknown importance sampling level: {args.importance_sampling_level}"
                         f". Possible values are 'token' and 'sequence'.")


def policy_variant(loss_type: str, level: str, args, epsilon_high: float
                   ) -> Tuple[Any, Dict[str, float]]:
    """(PolicyLossSpec, variant params) of TRL's policy term. TRL clamps no log-ratio."""
    from ...loss import PolicyLossSpec
    ratio = "token" if level == "token" else "sequence"
    if loss_type in CLIP_LOSS_TYPES:
        return PolicyLossSpec(ratio, "ppo", log_ratio_clamp=None), {"delta": args.delta}
    if loss_type == "cispo":      # TRL: sg(min(r, epsilon_high)), no lower bound
        return PolicyLossSpec(ratio, "cispo", log_ratio_clamp=None), \
            {"cispo_min": 0.0, "cispo_max": epsilon_high}
    if loss_type == "sapo":
        return PolicyLossSpec(ratio, "sapo", log_ratio_clamp=None), \
            {"tau_pos": args.sapo_temperature_pos, "tau_neg": args.sapo_temperature_neg}
    # vespo: phi of the sequence's summed log-ratio, whatever the level
    return PolicyLossSpec("sequence_sum", "vespo"), \
        {"k_pos": args.vespo_k_pos, "lambda_pos": args.vespo_lambda_pos,
         "k_neg": args.vespo_k_neg, "lambda_neg": args.vespo_lambda_neg}


def reduce_per_token(terms, maskf, reduction, denominator):
    """policy_loss's reduction (the names and denominators it takes) of per-token terms
    already multiplied by the mask [B, T]: for the KL term and VESPO's masked terms."""
    if reduction == "token_mean":
        return terms.sum() / (maskf.sum().clamp(min=1.0) if denominator is None
                              else denominator)
    row = terms.sum(-1)
    if reduction == "seq_mean_token_mean":
        row = row / maskf.sum(-1).clamp(min=1.0)
    return row.sum() / denominator


def vllm_is_ratio(old, rollout, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM importance-sampling ratio (``_generate_and_score_completions``), [B, T]
    for the token modes, [B, 1] for the sequence modes, detached fp32: d = (old - rollout) *
    mask with NaN -> 0 (a token the engine could not score gets ratio 1), summed over the row
    for sequence modes, exp(d); ``*_truncate`` clamps it to [clip_min, clip_max], ``*_mask``
    sets it to 0 outside [clip_min, clip_max] (a bound that is None is open)."""
    with torch.no_grad():
        diff = torch.nan_to_num((old.float() - rollout.float()) * mask.float(), nan=0.0)
        if mode in ("sequence_mask", "sequence_truncate"):
            diff = diff.sum(-1, keepdim=True)
        elif mode not in ("token_mask", "token_truncate"):
            raise ValueError(f"Unknown vLLM importance sampling level: {mode}. Possible values "
                             f"are 'token_truncate', 'token_mask', 'sequence_truncate', and "
                             f"'sequence_mask'.")
        ratio = torch.exp(diff)
        if mode.endswith("_truncate"):
            return torch.clamp(ratio, min=clip_min, max=clip_max)
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def ratio_with_grad(logprobs, old, mask, level):
    """TRL's coef_1: exp(lp - old) [B, T], or exp(masked mean) [B, 1] at sequence level."""
    log_ratio = logprobs - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return torch.exp(log_ratio)


class FusedGRPOLoss:
    """``_compute_loss`` of TRL's GRPOTrainer on glm_kernels' ops (module docstring). Mixed
    into a ``trl.GRPOTrainer`` subclass; reads the trainer's own attributes, as TRL's loss
    does. Subclasses add the IcePop gate through :meth:`_ratio_base` and :meth:`_is_weights`."""

    fused_chunk_size: Optional[int] = None
    fused_memory_budget: Optional[int] = DEFAULT_MEMORY_BUDGET

    # ------------------------------------------------------------------ model
    def _check_fused_model(self):
        problems = []
        if getattr(self, "_is_vlm", False):
            problems.append("a vision-language model")
        model = self.accelerator.unwrap_model(self.model)
        text_config = model.config.get_text_config()
        if getattr(text_config, "final_logit_softcapping", None) is not None:
            problems.append("final_logit_softcapping")
        head = model.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            problems.append("an LM head with a bias (or none)")
        if problems:
            raise ValueError(f"{type(self).__name__} does not support: " + "; ".join(problems))

    def _head(self):
        model = self.accelerator.unwrap_model(self.model)
        weight = model.get_output_embeddings().weight
        if hasattr(weight, "full_tensor"):          # FSDP2 DTensor, as TRL's fused head
            weight = weight.full_tensor()
        text_config = model.config.get_text_config()
        scale = getattr(text_config, "logit_scale", None)
        if scale is None:
            scale = getattr(text_config, "output_multiplier", None)
        scale = 1.0 if scale is None else float(scale)
        if not scale > 0:
            raise ValueError(f"logit scale {scale} must be > 0")
        return weight, self.temperature / scale

    def _last_hidden(self, model, inputs):
        """(hidden [B, T, H] predicting the completion tokens, LM head weight, temperature,
        the MoE load-balancing loss or None), the head in the autocast dtype as in TRL."""
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        t = completion_ids.size(1)
        weight, temperature = self._head()
        # MoE models return their load-balancing loss when asked for the router logits
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        with self.accelerator.autocast():
            outputs = model(input_ids=input_ids, attention_mask=attention_mask,
                            output_hidden_states=True, logits_to_keep=1, use_cache=False,
                            **router)
            last = outputs.hidden_states[-1]
            if not getattr(self, "_head_checked", False):
                self._check_head(last, weight, outputs.logits)
            dtype = _autocast_dtype(last.device.type) or weight.dtype
        hidden = last[:, -t - 1:-1, :].to(dtype)            # position p predicts p + 1
        aux_loss = outputs.aux_loss if self.aux_loss_enabled else None
        return hidden, weight.to(dtype), temperature, aux_loss

    def _check_head(self, last, weight, logits):
        """Once: the LM head applied to hidden_states[-1] gives the model's own logits
        (so hidden_states[-1] is the head's input, after the final norm)."""
        with torch.no_grad():     # inside the forward's autocast: the same GEMM dtype
            ours = torch.nn.functional.linear(last[:, -1], weight).float()
            theirs = logits[:, -1].float()
            err = (ours - theirs).norm() / theirs.norm().clamp(min=1e-12)
        tol = 1e-5 if logits.dtype == torch.float32 else 1e-2
        if not err <= tol:
            raise ValueError(
                f"the LM head applied to hidden_states[-1] does not reproduce the model's "
                f"logits (relative error {float(err):.2e}): this architecture post-processes "
                f"its logits or its last hidden state, which {type(self).__name__} does not "
                f"support")
        self._head_checked = True

    def _fused_logprobs(self, model, inputs):
        """(log pi_theta [B, T], entropy [B, T]) fp32, differentiable, no [B, T, V]; and the
        MoE load-balancing loss (None without one)."""
        hidden, weight, temperature, aux_loss = self._last_hidden(model, inputs)
        b, t, h = hidden.shape
        lp, entropy = fused_linear_logprobs(
            hidden.reshape(b * t, h), weight, inputs["completion_ids"].reshape(b * t),
            temperature=temperature, return_entropy=True, chunk_size=self.fused_chunk_size,
            memory_budget=self.fused_memory_budget)
        return lp.reshape(b, t), entropy.reshape(b, t), aux_loss

    # ------------------------------------------------------------------ loss
    def _ratio_base(self, inputs, old, lp):
        """The log-probs the policy ratio is taken against: TRL's pi_old (IcePop's coupled mode:
        the rollout's). ``lp``: log pi_theta, detached."""
        return old

    def _is_weights(self, inputs, lp, mask):
        """TRL's vLLM importance-sampling ratio [B, T] or [B, 1] where TRL applies one (VESPO:
        whenever the batch carries one, as TRL reads it). ``lp`` (log pi_theta, detached) and
        ``mask`` [B, T] are for subclasses whose weights depend on them (the IcePop gate)."""
        if self.loss_type == "vespo":
            return inputs.get("importance_sampling_ratio")
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return inputs["importance_sampling_ratio"]
        return None

    def _compute_loss(self, model, inputs):
        from ...loss import kl_penalty_terms, policy_loss
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else \
            completion_mask * inputs["tool_mask"]
        lp, entropies, aux_loss = self._fused_logprobs(model, inputs)
        maskf = mask.to(lp.dtype)

        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies.detach(), mask,
                                                      1 - self.top_entropy_quantile)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = lp.detach() if old is None else old
        base = self._ratio_base(inputs, old, lp.detach())

        # Detached multipliers of each token's policy term, as TRL applies them: the
        # off-policy sequence mask, the high-entropy mask, TRL's vLLM IS ratio (VESPO: the IS
        # ratio enters phi instead, and the masks multiply its per-token terms).
        masks = None
        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps", base)
            masks = self.get_off_policy_mask(
                advantages=advantages, per_token_logps=lp, sampling_per_token_logps=sampling,
                mask=mask, off_policy_threshold=self.off_policy_mask_threshold).float()
        if entropy_mask is not None:
            masks = entropy_mask.float() if masks is None else masks * entropy_mask
        is_ratio = self._is_weights(inputs, lp.detach(), mask != 0)
        if is_ratio is not None:
            is_ratio = is_ratio.float().expand_as(maskf).contiguous()

        spec, params = policy_variant(self.loss_type, self.importance_sampling_level,
                                      self.args, self.epsilon_high)
        adv = advantages.squeeze(1) if advantages.shape[1] == 1 else advantages
        mode = "train" if self.model.training else "eval"
        reduction, denominator, scale = self._reduction(inputs, mode, lp.shape[0])
        common = dict(variant=spec, eps_low=self.epsilon_low, eps_high=self.epsilon_high,
                      return_stats=True, **params)
        if self.loss_type == "vespo":
            per_token, stats = policy_loss(lp, base, adv, mask.bool(), token_weights=is_ratio,
                                           reduction="none", **common)
            if masks is not None:
                per_token = per_token * masks
            loss = reduce_per_token(per_token, maskf, reduction, denominator) * scale
        else:
            weights = is_ratio
            if masks is not None:
                masks = masks.expand_as(maskf)
                weights = masks.contiguous() if weights is None else weights * masks
            loss, stats = policy_loss(lp, base, adv, mask.bool(), token_weights=weights,
                                      reduction=reduction, denominator=denominator,
                                      loss_scale=scale, **common)

        per_token_kl = None
        if self.beta != 0.0:
            per_token_kl = kl_penalty_terms(lp, inputs["ref_per_token_logps"],
                                            kl_penalty="low_var_kl", clamp=False)
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * ratio_with_grad(lp, base, maskf,
                                                              self.importance_sampling_level)
            loss = loss + self.beta * scale * reduce_per_token(per_token_kl * maskf, maskf,
                                                               reduction, denominator)

        if self._entropy_bonus_enabled:
            loss = self._entropy_bonus(loss, (loss / scale).detach(), entropies, maskf,
                                       entropy_mask, mode)
        if aux_loss is not None:             # scaled for gradient accumulation, as TRL
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())
        with torch.no_grad():
            self._log_trl_metrics(mode, lp, base, advantages, maskf, entropies, stats,
                                  None if per_token_kl is None else per_token_kl.detach())
        self._after_loss(stats, mode)
        return loss

    def _after_loss(self, stats, mode):
        """Hook for subclasses (IcePop metrics)."""

    def _reduction(self, inputs, mode, rows):
        """TRL's loss_type normalisation as policy_loss's (reduction, denominator,
        loss_scale): the scale is TRL's gradient-accumulation division."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        lt = self.loss_type
        if lt in ("grpo", "sapo"):           # mean over ALL rows of each row's token mean
            return "seq_mean_token_mean", float(rows), 1.0 / accumulation
        if lt == "bnpo":
            return "token_mean", None, 1.0 / accumulation
        if lt == "dr_grpo":
            return "token_mean", float(rows * self.max_completion_length), 1.0 / accumulation
        if lt == "luspo":                    # mean over ALL rows of each row's token sum
            return "seq_mean_token_sum", float(rows), 1.0 / accumulation
        # cispo, dapo, vespo: num_items_in_batch spans the generation batch, so it is
        # rescaled to one accumulation window (and the accumulation is inside it)
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / \
            self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / \
                self.args.steps_per_generation
        return "token_mean", normalizer, 1.0

    def _entropy_bonus(self, loss, policy_loss_value, entropies, maskf, entropy_mask, mode):
        """loss - coef * (token mean of the entropy over the tokens the policy term acts on),
        with TRL's adaptive coefficient controller (updated at optimizer-step boundaries)."""
        effective = maskf if entropy_mask is None else maskf * entropy_mask
        entropy_mean = (entropies * effective).sum() / effective.sum().clamp(min=1.0)
        if self.use_adaptive_entropy:
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target \
                else 0.0
        else:
            coef = self.entropy_coef
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss - coef * (entropy_mean / accumulation)
        self._metrics[mode]["policy_loss"].append(
            self.accelerator.gather(policy_loss_value).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            window = torch.stack([(entropies * effective).sum(), effective.sum()]).detach()
            self._entropy_window_stats = window if self._entropy_window_stats is None else \
                self._entropy_window_stats + window
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (totals[0] / totals[1].clamp(min=1.0)).item()
                step = self.args.entropy_coef_delta
                self.entropy_coef = (min(self.entropy_coef + step, self.args.entropy_coef_max)
                                     if world <= self.args.entropy_target else
                                     max(self.entropy_coef - step, self.args.entropy_coef_min))
                self._last_world_entropy = world
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss

    # ------------------------------------------------------------------ metrics
    def _global_mean(self, x, maskf):
        """Masked token mean over every process ([B, 1]: one value per sequence)."""
        if x.shape[1] == 1:
            local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
        else:
            local = torch.stack([(x * maskf).sum(), maskf.sum().float()])
        totals = self.accelerator.reduce(local, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    @staticmethod
    def _row_mean(x, maskf):
        return x.squeeze(1) if x.shape[1] == 1 else (x * maskf).sum(-1) / maskf.sum(-1)

    def _log_trl_metrics(self, mode, lp, base, advantages, maskf, entropies, stats, kl):
        from trl.trainer.utils import nanmax, nanmin
        record = self._metrics[mode]
        if kl is not None:
            record["kl"].append(self._global_mean(kl, maskf))
        record["entropy"].append(self._global_mean(entropies.detach(), maskf))
        ratio = ratio_with_grad(lp.detach(), base, maskf, self.importance_sampling_level)
        if self.loss_type in CLIP_LOSS_TYPES:
            if self.args.delta is not None:
                ratio = ratio.clamp(max=self.args.delta)
            low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).float()
            high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).float()
            record["clip_ratio/low_mean"].append(self._global_mean(low, maskf))
            record["clip_ratio/high_mean"].append(self._global_mean(high, maskf))
            record["clip_ratio/region_mean"].append(
                self._global_mean(torch.maximum(low, high), maskf))
            gather = self.accelerator.gather
            record["clip_ratio/low_min"].append(nanmin(gather(self._row_mean(low, maskf))).item())
            record["clip_ratio/high_max"].append(
                nanmax(gather(self._row_mean(high, maskf))).item())
        elif self.loss_type == "cispo":
            clipped = ((ratio > self.epsilon_high) & (advantages > 0)).float()
            record["cispo_clip_ratio"].append(self._global_mean(clipped, maskf))
        elif self.loss_type == "vespo":     # policy_loss's mean of phi over the B rows
            rows = float(maskf.shape[0])
            local = torch.stack([stats["phi_mean"] * rows, torch.tensor(rows, device=lp.device)])
            totals = self.accelerator.reduce(local, reduction="sum")
            record["vespo/phi_seq_mean"].append((totals[0] / totals[1].clamp(min=1.0)).item())
