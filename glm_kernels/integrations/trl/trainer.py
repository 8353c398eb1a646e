"""TRL plug-in: ``FusedGRPOTrainer`` and ``IcePopGRPOTrainer``, ``trl.GRPOTrainer`` subclasses
whose loss is computed by glm_kernels from the last hidden states and the LM head.

Checked against TRL 1.16.0. The trainers override ``_compute_loss`` (the loss) and, for
IcePop, ``_generate_and_score_completions`` (to check the generation engine's log-probs are
there, and to compute pi_old in decoupled mode); generation, rewards, advantages, logging and
distribution stay TRL's. The classes are built on first access, so
``import glm_kernels.integrations.trl`` works without TRL; touching a class without TRL
raises an ImportError naming the pip line.

``FusedGRPOTrainer`` (any ``GRPOConfig``): TRL's loss for every loss option TRL 1.16 accepts
-- every ``loss_type``, ``importance_sampling_level`` token / sequence, ``beta > 0``,
``epsilon`` / ``epsilon_high``, ``delta`` (any value), ``top_entropy_quantile``,
``entropy_coef`` / ``use_adaptive_entropy``, the vLLM IS correction in every
``vllm_importance_sampling_mode``, ``off_policy_mask_threshold`` -- with TRL's loss, gradient
and metrics (:mod:`glm_kernels.integrations.trl.loss`). It refuses what TRL refuses (an
unknown ``loss_type`` or level already at construction), and, as model limits of the fused
path: vision-language models, an LM head with a bias, logit soft-capping. A MoE model's
load-balancing loss (``router_aux_loss_coef``) is added as TRL adds it.

``IcePopGRPOTrainer`` (``IcePopGRPOConfig``): the same loss with the IcePop gate composed on
it, modes (``IcePopGRPOConfig.icepop_mode``):

* ``"coupled"`` (default; GLM-5's TITO): the ratio's base is the generation engine's own
  log-prob of each sampled token (``sampling_per_token_logps``: vLLM's, or a
  ``rollout_func``'s such as :func:`generate_with_logprobs`), rho = exp(logp - rollout),
  gate g = 1[gate_low <= sg(rho) <= gate_high]. No pi_old is needed, so TRL's extra
  old-log-prob forward is skipped (with ``num_iterations > 1`` or generation steps not
  aligned with gradient accumulation TRL still runs it, and its result is not used).
* ``"decoupled"``: base pi_old (TRL's ``old_per_token_logps``, computed by the trainer when
  TRL did not), gate g = 1[gate_low <= k <= gate_high], k = exp(old - rollout).

Every ``vllm_importance_sampling_mode`` composes with both: the token's IS weight is TRL's
ratio computed exactly as TRL computes it (``trl_loss.vllm_is_ratio``, with TRL's
``vllm_importance_sampling_clip_min/max``) on (ratio base, rollout) -- coupled: base =
rollout, so the ratio is the mode applied to 1 (1 for the usual bounds) -- times g, where TRL
multiplies its ratio (VESPO: inside phi, where TRL's token_mask puts a masked token's 0). So
decoupled token_mask is IcePop's k 1[...] with the gate and TRL's bounds intersected,
token_truncate is TIS with the tokens outside the gate popped, the sequence modes weight a
sequence by TRL's sequence ratio and pop tokens in it; with the gate open ([0, inf]) the loss
is stock TRL's. ``vllm_importance_sampling_correction=False`` keeps the gate alone. The
trainer applies the correction itself (with or without vLLM) and turns TRL's off.

Gate bounds: ``icepop_gate_low`` / ``icepop_gate_high``, default 1/``icepop_beta`` and
``icepop_beta`` (beta = 2). Every loss option of ``FusedGRPOTrainer`` composes with the gate.
The default recipe (``loss_type`` grpo / bnpo / dr_grpo / dapo at token level, no KL, no
entropy option, no off-policy mask, no MoE auxiliary loss, ``delta`` None or
>= 1 + ``epsilon_high``; coupled, or decoupled token_mask; finite gate) runs in one
fused pass (``fused_linear_icepop_loss``: log-probs, gate, clip and the gradients of the
hidden states and the LM head together) and logs ``icepop/*`` metrics (pop / clip fractions,
ratio range, the mismatch metrics); any other option goes through the general path
(``fused_linear_logprobs`` then ``policy_loss``), which logs TRL's metric keys and
``icepop/pop_frac``.

Differences from TRL's own token_mask loss, by design (docs/design.md 3.1): a token whose rollout
log-prob is NaN is popped (TRL gives it ratio 1; coupled mode takes a non-finite rollout
log-prob's log-ratio as 0 in the sequence mean and the KL correction); log-ratios are clamped
to [-20, 20] on the single-pass path.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Dict, List, Optional

import torch

from ...loss import MISMATCH_KEYS, fused_linear_icepop_loss
from .loss import (DEFAULT_MEMORY_BUDGET, LOSS_TYPES, FusedGRPOLoss, check_loss_options,
                   vllm_is_ratio)

__all__ = ["FusedGRPOTrainer", "IcePopGRPOTrainer", "IcePopGRPOConfig", "generate_with_logprobs",
           "INSTALL_HINT", "LOSS_TYPES", "SUPPORTED_LOSS_TYPES"]

INSTALL_HINT = "pip install 'trl==1.16.0' 'transformers==5.10.4'"
# The loss types of IcePop's single fused pass (loss and gradient in one pass over the
# vocabulary); every other option goes through trl_loss's path (log-probs, then the loss).
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
MODES = ("coupled", "decoupled")
TOKEN_IS_MODES = ("token_mask", "token_truncate")

_classes: Dict[str, type] = {}


def _import_trl():
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise ImportError(f"glm_kernels.integrations.trl needs TRL ({exc}); install it with: "
                          f"{INSTALL_HINT}") from exc
    return trl, GRPOConfig, GRPOTrainer


def _trl_disable_gradient_checkpointing():
    """TRL's context manager that switches gradient checkpointing off around its generation
    and scoring forwards (trl.models.utils, TRL 1.16)."""
    _import_trl()
    from trl.models.utils import disable_gradient_checkpointing
    return disable_gradient_checkpointing


def __getattr__(name: str):
    if name in ("FusedGRPOTrainer", "IcePopGRPOTrainer", "IcePopGRPOConfig"):
        if not _classes:
            _build_classes()
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- rollout helper
def generate_with_logprobs(prompts: List[Any], trainer) -> Dict[str, List[List[Any]]]:
    """A TRL ``rollout_func`` that samples with ``transformers``' ``generate`` and records the
    sampler's own log-prob of every generated token (log-softmax of the processed scores:
    after temperature / top-k / top-p, as vLLM's ``processed_logprobs``).

    For CPU runs, tests and single-process jobs without vLLM, so the coupled (TITO) mode has
    the generation engine's log-probs; with vLLM (``use_vllm=True``) TRL records them itself
    and no rollout_func is needed. Prompts are plain strings (one completion each; TRL's
    sampler already repeats every prompt ``num_generations`` times); the completion stops
    after the first EOS, as TRL's own transformers path does.
    """
    if not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TypeError(f"prompts[{i}] must be a string (generate_with_logprobs does not "
                            f"apply chat templates), got {type(prompt).__name__}")
    generation_config = getattr(trainer, "generation_config", None)
    if generation_config is None:
        raise ValueError("generate_with_logprobs samples with transformers' generate and needs "
                         "the trainer's generation_config: use it without use_vllm and without "
                         "use_transformers_continuous_batching")
    tokenizer = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    # The scores are asked for through a copy of the config: passing output_scores next to
    # generation_config is deprecated in transformers 5, and the trainer's config stays as is.
    generation_config = copy.deepcopy(generation_config)
    generation_config.output_scores = True
    generation_config.return_dict_in_generate = True
    prompt_ids = tokenizer(text=list(prompts))["input_ids"]
    pad_id = tokenizer.pad_token_id
    width = max(len(ids) for ids in prompt_ids)
    device = next(model.parameters()).device
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):                   # left padding
        if ids:
            input_ids[row, width - len(ids):] = torch.tensor(ids, device=device)
            attention[row, width - len(ids):] = 1
    # TRL turns gradient checkpointing on by default (GRPOConfig), and under it transformers
    # drops the KV cache while generate still feeds one new token a step: the recorded
    # log-probs were then not the model's (before any update exp(train - rollout) spread over
    # [0.84, 1.13] on tests/integrations/test_trl.py's model). TRL's own generation turns it
    # off for the call; TRL's disable_gradient_checkpointing turns it back on with the
    # trainer's kwargs afterwards, also when generate raises.
    without_checkpointing = _trl_disable_gradient_checkpointing()
    with torch.no_grad(), without_checkpointing(
            model, trainer.args.gradient_checkpointing_kwargs):
        out = model.generate(input_ids=input_ids, attention_mask=attention,
                             generation_config=generation_config)
    generated = out.sequences[:, width:]
    if generated.shape[1] == 0:
        return {"prompt_ids": [list(p) for p in prompt_ids],
                "completion_ids": [[] for _ in prompt_ids], "logprobs": [[] for _ in prompt_ids]}
    scores = torch.stack(out.scores, dim=1).float()          # [B, T, V] processed logits
    logprobs = torch.log_softmax(scores, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
    eos = set(trainer.eos_token_ids if hasattr(trainer, "eos_token_ids")
              else [tokenizer.eos_token_id])
    completion_ids, completion_logprobs = [], []
    for ids, lps in zip(generated.tolist(), logprobs.tolist()):
        end = next((i + 1 for i, tok in enumerate(ids) if tok in eos), len(ids))
        completion_ids.append(ids[:end])
        completion_logprobs.append(lps[:end])
    return {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": completion_ids,
            "logprobs": completion_logprobs}


# --------------------------------------------------------------------------- classes
def _build_classes() -> None:
    _, GRPOConfig, GRPOTrainer = _import_trl()

    @dataclasses.dataclass
    class IcePopGRPOConfig(GRPOConfig):
        """``GRPOConfig`` plus the IcePop fields (see the module docstring)."""

        icepop_mode: str = dataclasses.field(
            default="coupled", metadata={"help": "'coupled' (ratio base = the generation "
                                         "engine's log-probs, no old-log-prob forward) or "
                                         "'decoupled' (base = pi_old, gate on pi_old / "
                                         "pi_rollout)."})
        icepop_beta: float = dataclasses.field(
            default=2.0, metadata={"help": "IcePop gate [1/beta, beta] unless "
                                   "icepop_gate_low / icepop_gate_high are set."})
        icepop_gate_low: Optional[float] = dataclasses.field(default=None)
        icepop_gate_high: Optional[float] = dataclasses.field(default=None)
        icepop_chunk_size: Optional[int] = dataclasses.field(
            default=None, metadata={"help": "Tokens per [chunk, V] logits chunk (default: "
                                    "from icepop_memory_budget)."})
        icepop_memory_budget: Optional[int] = dataclasses.field(
            default=DEFAULT_MEMORY_BUDGET,
            metadata={"help": "Bytes for the [chunk, V] logits chunk (default 64 MiB; the "
                      "torch path on CPU holds about five fp32 chunks at once)."})
        # TRL's default is sequence_mask; IcePop is token level.
        vllm_importance_sampling_mode: str = dataclasses.field(default="token_mask")

        def __post_init__(self):
            super().__post_init__()
            if self.icepop_mode not in MODES:
                raise ValueError(f"icepop_mode={self.icepop_mode!r}: expected one of "
                                 f"{list(MODES)}")
            if isinstance(self.icepop_beta, bool) or not (
                    isinstance(self.icepop_beta, (int, float)) and self.icepop_beta > 0
                    and math.isfinite(self.icepop_beta)):
                raise ValueError(f"icepop_beta must be a finite number > 0, got "
                                 f"{self.icepop_beta!r}")
            low, high = self.icepop_gate()
            if not 0.0 <= low <= high:
                raise ValueError(f"IcePop gate needs 0 <= icepop_gate_low <= icepop_gate_high, "
                                 f"got [{low}, {high}]")
            # The trainer applies TRL's IS correction with or without vLLM, so it refuses
            # what TRL refuses when it applies it (TRL: GRPOTrainer.__init__ with vLLM).
            if self.loss_type == "vespo" and self.vllm_importance_sampling_correction and \
                    self.vllm_importance_sampling_mode not in TOKEN_IS_MODES:
                raise ValueError(
                    f"VESPO loss requires `vllm_importance_sampling_mode` to be either "
                    f"'token_truncate' or 'token_mask'. Got: "
                    f"{self.vllm_importance_sampling_mode}.")

        def icepop_gate(self):
            low = (1.0 / self.icepop_beta if self.icepop_gate_low is None
                   else float(self.icepop_gate_low))
            high = (float(self.icepop_beta) if self.icepop_gate_high is None
                    else float(self.icepop_gate_high))
            return low, high

    class FusedGRPOTrainer(FusedGRPOLoss, GRPOTrainer):
        """``trl.GRPOTrainer`` whose loss is computed by glm_kernels (log-probs and entropy
        from the hidden states and the LM head, the policy term, the KL and the entropy
        bonus: :mod:`glm_kernels.integrations.trl.loss`) for every loss option of
        ``GRPOConfig``, equal to TRL's own loss. Arguments: ``GRPOTrainer``'s.
        ``fused_calls`` counts the loss calls."""

        def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
            if args is not None:
                check_loss_options(args)
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
            self._check_fused_model()
            self._head_checked = False
            self.fused_calls = 0

        def _compute_loss(self, model, inputs):
            self.fused_calls += 1
            return FusedGRPOLoss._compute_loss(self, model, inputs)

    class IcePopGRPOTrainer(FusedGRPOTrainer):
        """``trl.GRPOTrainer`` with the IcePop gate of glm_kernels on TRL's loss (module
        docstring). ``args`` must be an :class:`IcePopGRPOConfig`; every other argument is
        ``GRPOTrainer``'s. ``icepop_calls`` counts the loss calls."""

        def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
            if not isinstance(args, IcePopGRPOConfig):
                raise TypeError(f"args must be an IcePopGRPOConfig (GRPOConfig plus the IcePop "
                                f"fields), got {type(args).__name__}")
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
            self.icepop_config = args
            self.fused_chunk_size = args.icepop_chunk_size
            self.fused_memory_budget = args.icepop_memory_budget
            # The trainer applies TRL's IS correction itself (with the gate, from the raw
            # log-probs, also without vLLM); TRL's own, and the old-log-prob forward it
            # triggers, is turned off.
            self.icepop_is_correction = bool(args.vllm_importance_sampling_correction)
            self.vllm_importance_sampling_correction = False
            self.icepop_calls = 0

        # ------------------------------------------------------------------ generation
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if output.get("sampling_per_token_logps") is None:
                raise ValueError(
                    "IcePopGRPOTrainer needs the generation engine's per-token log-probs: "
                    "use_vllm=True (TRL records them), or rollout_func="
                    "glm_kernels.integrations.trl.generate_with_logprobs")
            if self.icepop_config.icepop_mode == "decoupled" and \
                    output.get("old_per_token_logps") is None:
                output["old_per_token_logps"] = self._old_logprobs(output)
            return output

        def _old_logprobs(self, output):
            """pi_old of the completion tokens, by TRL's own scoring function (no grad)."""
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            mode = "train" if self.model.training else "eval"
            batch_size = (self.args.per_device_train_batch_size if mode == "train"
                          else self.args.per_device_eval_batch_size)
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention, output["completion_ids"].size(1),
                    batch_size=batch_size)
            return old

        # ------------------------------------------------------------------ loss
        def _single_pass(self) -> bool:
            """The default recipe (token-level clip, no KL, no entropy option, no OPSM, no
            delta below 1 + epsilon_high) with a gate the fused pass expresses: one fused
            pass computes the loss and its gradient (``fused_linear_icepop_loss``: the logits
            once, not twice)."""
            return (self.loss_type in SUPPORTED_LOSS_TYPES
                    and self.importance_sampling_level == "token" and self.beta == 0.0
                    and not self.aux_loss_enabled
                    and self.top_entropy_quantile >= 1.0 and not self._entropy_bonus_enabled
                    and self.off_policy_mask_threshold is None
                    and (self.args.delta is None or self.args.delta >= 1 + self.epsilon_high)
                    and self._single_pass_gate() is not None)

        def _single_pass_gate(self):
            """(gate_low, gate_high) of the fused pass, or None when the IS mode does not
            reduce to its gate (finite bounds, low < high). Coupled: TRL's IS ratio is 1, kept
            by the mode as 1 for the usual bounds. Decoupled token_mask: TRL's weight
            k 1[C_min <= k <= C_max] times the gate 1[lo <= k <= hi] is the fused decoupled
            weight k 1[max(lo, C_min) <= k <= min(hi, C_max)]."""
            low, high = self.icepop_config.icepop_gate()
            if self.icepop_config.icepop_mode == "coupled":
                if self.icepop_is_correction and self._coupled_is_weight() != 1.0:
                    return None
            elif not self.icepop_is_correction or \
                    self.vllm_importance_sampling_mode != "token_mask":
                return None
            else:
                c_min, c_max = self.vllm_importance_sampling_clip_min, \
                    self.vllm_importance_sampling_clip_max
                low = low if c_min is None else max(low, c_min)
                high = high if c_max is None else min(high, c_max)
            if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low < high):
                return None
            return low, high

        def _coupled_is_weight(self) -> float:
            """TRL's IS weight in coupled mode: pi_old is the rollout policy, so the ratio is 1
            and the mode acts on 1 (clamp to [C_min, C_max], or 0 outside it)."""
            c_min, c_max = self.vllm_importance_sampling_clip_min, \
                self.vllm_importance_sampling_clip_max
            c_min = -math.inf if c_min is None else c_min
            c_max = math.inf if c_max is None else c_max
            if self.vllm_importance_sampling_mode.endswith("_truncate"):
                return min(max(1.0, c_min), c_max)
            return 1.0 if c_min <= 1.0 <= c_max else 0.0

        def _compute_loss(self, model, inputs):
            self.icepop_calls += 1
            if self._single_pass():
                return self._single_pass_loss(model, inputs)
            return FusedGRPOLoss._compute_loss(self, model, inputs)

        def _ratio_base(self, inputs, old, lp):
            """Coupled: the rollout log-probs; one the engine could not give (NaN, -inf) is
            popped by the gate and its log-ratio taken as 0 (TRL's NaN -> ratio 1) where the
            row enters: the sequence ratio's mean, the KL's bias correction."""
            if self.icepop_config.icepop_mode == "coupled":
                rollout = inputs["sampling_per_token_logps"].float()
                return torch.where(torch.isfinite(rollout), rollout, lp)
            return old

        def _is_weights(self, inputs, lp, mask):
            """TRL's IS ratio on (ratio base, rollout) in the configured mode (coupled: base =
            rollout, so the mode acts on 1) times the IcePop gate, as a 0/1 factor: the
            weight TRL's token_mask gives a masked token. VESPO takes it inside phi, as TRL
            takes its IS ratio (a popped token's log(0) is clamped to log(1e-8))."""
            cfg = self.icepop_config
            rollout = inputs["sampling_per_token_logps"].float()
            base = rollout if cfg.icepop_mode == "coupled" else \
                inputs["old_per_token_logps"].float()
            keep = self._icepop_keep(lp if cfg.icepop_mode == "coupled" else base, rollout,
                                     mask)
            maskf = mask.float()
            self._icepop_pop_frac = ((~keep) & mask).sum() / maskf.sum().clamp(min=1.0)
            if not self.icepop_is_correction:
                return keep.float()
            ratio = vllm_is_ratio(base, rollout, mask, self.vllm_importance_sampling_mode,
                                  self.vllm_importance_sampling_clip_min,
                                  self.vllm_importance_sampling_clip_max)
            # where, not a product: a popped token's TRL ratio may be inf (mask mode, no C_max)
            return torch.where(keep, ratio, torch.zeros((), device=ratio.device))

        def _icepop_keep(self, numerator, rollout, mask):
            """The gate [B, T] bool: lo <= exp(numerator - rollout) <= hi (numerator: log
            pi_theta coupled, pi_old decoupled; a NaN rollout log-prob fails it), True off the
            mask (a padding token is not popped: it would enter VESPO's phi)."""
            low, high = self.icepop_config.icepop_gate()
            ratio = torch.exp(numerator.float() - rollout)
            return ((ratio >= low) & (ratio <= high)) | ~mask

        def _after_loss(self, stats, mode):
            value = self.accelerator.gather(self._icepop_pop_frac.reshape(1)).float()
            self._metrics[mode]["icepop/pop_frac"].append(value.nanmean().item())

        def _single_pass_loss(self, model, inputs):
            cfg = self.icepop_config
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            mask = completion_mask if "tool_mask" not in inputs else \
                completion_mask * inputs["tool_mask"]
            mask = mask != 0
            hidden, weight, temperature, _ = self._last_hidden(model, inputs)
            advantages = inputs["advantages"]
            if advantages.dim() == 2 and advantages.shape[1] == 1:
                advantages = advantages.squeeze(1)
            rollout = inputs["sampling_per_token_logps"].float()
            old = None if cfg.icepop_mode == "coupled" else inputs["old_per_token_logps"].float()
            gate_low, gate_high = self._single_pass_gate()
            reduction, factor = self._single_pass_reduction(inputs, mask)
            # TRL's two-sided clipping: -min(min(r, delta) A, clip(r) A) caps a negative-
            # advantage token at -delta A, the dual clip (delta >= 1 + epsilon_high here).
            loss, metrics = fused_linear_icepop_loss(
                hidden, weight, completion_ids, rollout, advantages, mask, old_logprobs=old,
                gate_low=gate_low, gate_high=gate_high, reduction=reduction,
                temperature=temperature, eps_low=self.epsilon_low, eps_high=self.epsilon_high,
                dual_clip=self.args.delta, chunk_size=cfg.icepop_chunk_size,
                memory_budget=cfg.icepop_memory_budget, return_metrics=True)
            loss = loss * factor
            self._log_icepop(metrics)
            return loss

        def _single_pass_reduction(self, inputs, mask):
            """(fused reduction, scalar factor) reproducing TRL's loss_type normalisation."""
            train = self.model.training
            accumulation = self.current_gradient_accumulation_steps if train else 1.0
            b = mask.shape[0]
            if self.loss_type == "bnpo":
                return "token_mean", 1.0 / accumulation
            if self.loss_type == "grpo":
                # TRL: mean over all B rows of each row's token mean (empty rows count as 0);
                # the fused seq_mean_token_mean averages over the non-empty rows only.
                valid = (mask.sum(-1) > 0).sum().float()
                return "seq_mean_token_mean", valid / b / accumulation
            if self.loss_type == "dr_grpo":
                return "sum", 1.0 / (b * self.max_completion_length) / accumulation
            # dapo: TRL's normaliser, num_items_in_batch spans the generation batch
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / \
                self.accelerator.num_processes
            if train:
                normalizer = normalizer * self.current_gradient_accumulation_steps / \
                    self.args.steps_per_generation
            return "sum", 1.0 / normalizer

        def _log_icepop(self, metrics):
            mode = "train" if self.model.training else "eval"
            # MISMATCH_KEYS: train (or the recomputed old) vs the engine's log-probs, same pass.
            for key in ("pop_frac", "clip_frac", "ratio_mean", "ratio_max",
                        "ratio_min") + MISMATCH_KEYS:
                value = self.accelerator.gather(metrics[key].reshape(1)).float()
                self._metrics[mode][f"icepop/{key}"].append(value.nanmean().item())

    for cls in (IcePopGRPOConfig, FusedGRPOTrainer, IcePopGRPOTrainer):
        cls.__module__ = __name__
        _classes[cls.__name__] = cls
