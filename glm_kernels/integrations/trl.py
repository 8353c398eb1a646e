"""TRL plug-in: ``IcePopGRPOTrainer``, a ``trl.GRPOTrainer`` whose policy loss is IcePop
computed by glm_kernels in one pass from the last hidden states and the LM head.

Checked against TRL 1.16.0. The trainer overrides two hooks of ``GRPOTrainer`` and nothing
else: ``_compute_loss`` (the loss) and ``_generate_and_score_completions`` (to check the
generation engine's log-probs are there, and to compute pi_old in decoupled mode). The
classes are built on first access, so ``import glm_kernels.integrations.trl`` works without
TRL; touching ``IcePopGRPOTrainer`` or ``IcePopGRPOConfig`` without TRL raises an
ImportError naming the pip line.

Loss (``fused_linear_icepop_loss``): the trainer runs the model once for the hidden states
(``output_hidden_states=True``, ``logits_to_keep=1``: the [B, T, V] logits never exist), then
computes log-probs, the IcePop gate, the PPO clip and the gradients of the hidden states and
the LM head in one chunked pass over the vocabulary.

Modes (``IcePopGRPOConfig.icepop_mode``):

* ``"coupled"`` (default; GLM-5's TITO): the ratio's base is the generation engine's own
  log-prob of each sampled token (``sampling_per_token_logps``: vLLM's, or a
  ``rollout_func``'s such as :func:`generate_with_logprobs`), rho = exp(logp - rollout),
  gated to [gate_low, gate_high]. No pi_old is needed, so TRL's extra old-log-prob forward is
  skipped (the trainer turns TRL's own IS correction off, which is what triggers it; with
  ``num_iterations > 1`` or generation steps not aligned with gradient accumulation TRL
  still runs that forward, and its result is not used).
* ``"decoupled"``: base pi_old (TRL's ``old_per_token_logps``, computed by the trainer when
  TRL did not), gate on k = exp(old - rollout) according to TRL's
  ``vllm_importance_sampling_mode``: ``"token_mask"`` is the IcePop gate
  ``w = k * 1[gate_low <= k <= gate_high]`` (TRL's token_mask with C_min/C_max = the gate),
  ``"token_truncate"`` is TIS ``w = clamp(k, C_min, C_max)`` with TRL's
  ``vllm_importance_sampling_clip_min/max``. Sequence-level modes are refused.

Gate bounds: ``icepop_gate_low`` / ``icepop_gate_high``, default 1/``icepop_beta`` and
``icepop_beta`` (beta = 2). Clip: TRL's ``epsilon`` / ``epsilon_high``. Reductions follow
TRL's ``loss_type`` exactly: ``bnpo`` = token mean of the micro-batch, ``grpo`` = mean over
all sequences of their token means, ``dr_grpo`` = sum / (B * max_completion_length),
``dapo`` = sum / TRL's ``num_items_in_batch`` normaliser; gradient-accumulation scaling as
TRL does it. Not supported (clear error at construction): loss types cispo / sapo / luspo /
vespo, ``beta != 0`` (the reference-KL term needs per-token log-probs with gradient),
sequence-level importance sampling, ``top_entropy_quantile < 1``, an entropy bonus,
``off_policy_mask_threshold``, ``delta`` below ``1 + epsilon_high`` (from there TRL's
two-sided clipping is the loss's ``dual_clip``), MoE auxiliary losses, vision-language models,
an LM head with a bias or logit soft-capping.

Differences from TRL's own token_mask loss, by design (DESIGN 3.1): a token whose rollout
log-prob is NaN is popped (TRL gives it ratio 1); log-ratios are clamped to [-20, 20].
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Dict, List, Optional

import torch

from ..loss import fused_linear_icepop_loss
from ..loss.mismatch import MISMATCH_KEYS

__all__ = ["IcePopGRPOTrainer", "IcePopGRPOConfig", "generate_with_logprobs", "INSTALL_HINT",
           "SUPPORTED_LOSS_TYPES"]

INSTALL_HINT = "pip install 'trl==1.16.0' 'transformers==5.10.4'"
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
MODES = ("coupled", "decoupled")
DECOUPLED_IS_MODES = ("token_mask", "token_truncate")
# The [chunk, V] logits chunk of the fused loss. fused_linear_icepop_loss's own default is
# 512 MiB; at V = 151,936 the CPU (torch) path then peaked above TRL's whole step (measured,
# benchmarks/notes/trl.md); 64 MiB still gives GEMMs of 110 (fp32) or 128 (bf16) tokens x V.
DEFAULT_MEMORY_BUDGET = 64 << 20

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
    if name in ("IcePopGRPOTrainer", "IcePopGRPOConfig"):
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
            if self.icepop_mode == "decoupled" and \
                    self.vllm_importance_sampling_mode not in DECOUPLED_IS_MODES:
                raise ValueError(
                    f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r}: "
                    f"decoupled IcePop supports {list(DECOUPLED_IS_MODES)} (token_mask = the "
                    f"IcePop gate, token_truncate = TIS)")
            if self.icepop_mode == "coupled" and \
                    self.vllm_importance_sampling_mode == "token_truncate":
                raise ValueError("vllm_importance_sampling_mode='token_truncate' (TIS) needs "
                                 "icepop_mode='decoupled'; coupled mode gates on "
                                 "exp(logp - rollout) itself")

        def icepop_gate(self):
            low = (1.0 / self.icepop_beta if self.icepop_gate_low is None
                   else float(self.icepop_gate_low))
            high = (float(self.icepop_beta) if self.icepop_gate_high is None
                    else float(self.icepop_gate_high))
            return low, high

    class IcePopGRPOTrainer(GRPOTrainer):
        """``trl.GRPOTrainer`` with the IcePop loss of glm_kernels (module docstring).

        ``args`` must be an :class:`IcePopGRPOConfig`; every other argument is
        ``GRPOTrainer``'s. ``icepop_calls`` counts the fused loss calls.
        """

        def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
            if not isinstance(args, IcePopGRPOConfig):
                raise TypeError(f"args must be an IcePopGRPOConfig (GRPOConfig plus the IcePop "
                                f"fields), got {type(args).__name__}")
            self._check_args(args)
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
            self.icepop_config = args
            self._check_model()
            # The loss applies the IS correction itself, from the raw log-probs; TRL's own
            # (and the old-log-prob forward it triggers) is turned off.
            self.vllm_importance_sampling_correction = False
            self.icepop_calls = 0
            self._head_checked = False

        @staticmethod
        def _check_args(args):
            """Refuse, before TRL builds anything, what the fused IcePop loss cannot do."""
            problems = []
            if args.loss_type not in SUPPORTED_LOSS_TYPES:
                problems.append(f"loss_type={args.loss_type!r} (supported: "
                                f"{list(SUPPORTED_LOSS_TYPES)})")
            if args.beta != 0.0:
                problems.append(f"beta={args.beta} (the reference-KL term needs per-token "
                                "log-probs with gradient; set beta=0.0)")
            if args.importance_sampling_level != "token":
                problems.append(f"importance_sampling_level={args.importance_sampling_level!r}"
                                " (IcePop is token level)")
            if args.top_entropy_quantile < 1.0:
                problems.append(f"top_entropy_quantile={args.top_entropy_quantile} (needs "
                                "per-token entropies)")
            if args.entropy_coef != 0.0 or getattr(args, "use_adaptive_entropy", False):
                problems.append("an entropy bonus (entropy_coef / use_adaptive_entropy)")
            if args.off_policy_mask_threshold is not None:
                problems.append("off_policy_mask_threshold")
            delta = getattr(args, "delta", None)
            epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
            if delta is not None and not delta >= 1.0 + epsilon_high:
                problems.append(f"delta={delta} below 1 + epsilon_high = {1 + epsilon_high} "
                                "(two-sided clipping is the kernel's dual clip only from "
                                "there; TRL recommends delta > 1 + epsilon)")
            if problems:
                raise ValueError("IcePopGRPOTrainer does not support: " + "; ".join(problems))

        def _check_model(self):
            problems = []
            if self.aux_loss_enabled:
                problems.append("a MoE auxiliary loss (router_aux_loss_coef)")
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
                raise ValueError("IcePopGRPOTrainer does not support: " + "; ".join(problems))

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

        def _compute_loss(self, model, inputs):
            cfg = self.icepop_config
            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            t = completion_ids.size(1)
            mask = completion_mask if "tool_mask" not in inputs else \
                completion_mask * inputs["tool_mask"]
            mask = mask != 0
            weight, temperature = self._head()
            with self.accelerator.autocast():
                outputs = model(input_ids=input_ids, attention_mask=attention_mask,
                                output_hidden_states=True, logits_to_keep=1, use_cache=False)
                last = outputs.hidden_states[-1]
                if not self._head_checked:
                    self._check_head(last, weight, outputs.logits)
                # Under mixed precision the LM head runs in the autocast dtype, as in TRL.
                dtype = _autocast_dtype(last.device.type) or weight.dtype
            hidden = last[:, -t - 1:-1, :].to(dtype)            # position p predicts p + 1
            weight = weight.to(dtype)

            advantages = inputs["advantages"]
            if advantages.dim() == 2 and advantages.shape[1] == 1:
                advantages = advantages.squeeze(1)
            rollout = inputs["sampling_per_token_logps"].float()
            # TRL's two-sided clipping: -min(min(r, delta) A, clip(r) A) caps a negative-
            # advantage token at -delta A, the dual clip (delta >= 1 + epsilon_high, checked).
            kwargs = dict(temperature=temperature, eps_low=self.epsilon_low,
                          eps_high=self.epsilon_high, dual_clip=self.args.delta,
                          chunk_size=cfg.icepop_chunk_size,
                          memory_budget=cfg.icepop_memory_budget, return_metrics=True)
            gate_low, gate_high = cfg.icepop_gate()
            if cfg.icepop_mode == "coupled":
                base, old = rollout, None
            else:
                old = inputs["old_per_token_logps"].float()
                if cfg.vllm_importance_sampling_mode == "token_mask":
                    base = rollout
                else:   # token_truncate (TIS): w = clamp(k, C_min, C_max), folded into A
                    k = torch.exp((old - rollout).clamp(-20.0, 20.0))
                    w = k.clamp(min=self.vllm_importance_sampling_clip_min,
                                max=self.vllm_importance_sampling_clip_max)
                    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
                    advantages = torch.where(mask, adv * w, torch.zeros_like(w))
                    base, gate_low, gate_high = old, 0.0, 1.0     # k' = 1: always kept

            reduction, factor = self._reduction(inputs, mask)
            loss, metrics = fused_linear_icepop_loss(
                hidden, weight, completion_ids, base, advantages, mask, old_logprobs=old,
                gate_low=gate_low, gate_high=gate_high, reduction=reduction, **kwargs)
            loss = loss * factor
            self.icepop_calls += 1
            self._log_icepop(metrics, loss)
            return loss

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
                    f"its logits or its last hidden state, which IcePopGRPOTrainer does not "
                    f"support")
            self._head_checked = True

        def _reduction(self, inputs, mask):
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

        def _log_icepop(self, metrics, loss):
            mode = "train" if self.model.training else "eval"
            # MISMATCH_KEYS: train (or the recomputed old) vs the engine's log-probs, same pass.
            for key in ("pop_frac", "clip_frac", "ratio_mean", "ratio_max",
                        "ratio_min") + MISMATCH_KEYS:
                value = self.accelerator.gather(metrics[key].reshape(1)).float()
                self._metrics[mode][f"icepop/{key}"].append(value.nanmean().item())

    IcePopGRPOConfig.__module__ = __name__
    IcePopGRPOTrainer.__module__ = __name__
    _classes["IcePopGRPOConfig"] = IcePopGRPOConfig
    _classes["IcePopGRPOTrainer"] = IcePopGRPOTrainer
