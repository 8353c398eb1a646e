"""slime plug-ins: IcePop through glm_kernels, loaded by slime's custom-path flags.

Nothing here imports slime or Megatron at module import; the functions only read the
``args`` namespace and the batch dicts slime hands them (TP > 1 imports Megatron's ``mpu`` for
the TP group, CP > 1 imports slime's own CP slicers lazily, so the CP layout is slime's).
Signatures follow THUDM/slime at commit 624b824 (2026-08-21):

* :func:`icepop_loss_function` -- ``--loss-type custom_loss
  --custom-loss-function-path glm_kernels.integrations.slime.icepop_loss_function``.
  Called as ``func(args, batch, logits, sum_of_sample_mean)`` and must return
  ``(loss, metrics)`` (slime/backends/megatron_utils/loss.py, ``loss_function``).
* :func:`icepop_tis_function` -- ``--use-tis
  --custom-tis-function-path glm_kernels.integrations.slime.icepop_tis_function`` with the
  default ``--loss-type policy_loss``. Called with keyword arguments ``args, pg_loss,
  train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths`` and
  must return ``(pg_loss, loss_masks, metrics)`` (same file, ``policy_loss_function``).
* :func:`opd_log_ratio_advantages` -- ``--custom-advantage-function-path
  glm_kernels.integrations.slime.opd_log_ratio_advantages`` with ``--use-opd
  --opd-kl-coef 0``. Called as ``fn(args, rollout_data)``; sets ``advantages`` and
  ``returns`` in place (same file, ``compute_advantages_and_returns``).

slime loads each path with ``importlib`` on the dotted name (slime/utils/misc.py,
``load_function``). The IcePop gate is slime's TIS interval ``[--tis-clip-low, --tis-clip]``
(IcePop with beta = 2: ``--tis-clip-low 0.5 --tis-clip 2.0``); the PPO clip is
``[1 - --eps-clip, 1 + --eps-clip-high]``. docs/slime.md has the full flag list.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...loss import icepop_loss, opd_advantages, selective_logprobs
from . import _topp as _slime_topp

# The mismatch metrics that are token means (the rest are per sequence: see
# icepop_loss_function's Returns).
TOKEN_MISMATCH_KEYS = ("kl", "k3_kl", "chi2_token", "rollout_is_mean",
                       "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low",
                       "rollout_is_oob_ratio", "nonfinite_frac")

__all__ = ["icepop_loss_function", "icepop_tis_function", "opd_log_ratio_advantages",
           "icepop_gate_weights"]


def _gate_bounds(args) -> Tuple[float, float]:
    low, high = float(getattr(args, "tis_clip_low", 0.0)), float(getattr(args, "tis_clip", 2.0))
    if not 0.0 <= low < high:
        raise ValueError(f"IcePop gate needs 0 <= --tis-clip-low < --tis-clip, got "
                         f"tis_clip_low={low}, tis_clip={high} (IcePop beta=2: 0.5 and 2.0)")
    return low, high


def _clip_eps(args) -> Tuple[float, float, Optional[float]]:
    """(eps_clip, eps_clip_high, eps_clip_c or None): slime's PPO clip and its dual clip."""
    low = float(getattr(args, "eps_clip", 0.2))
    high = getattr(args, "eps_clip_high", None)
    dual = getattr(args, "eps_clip_c", None)
    if dual is not None and not float(dual) > 1.0:
        raise ValueError(f"--eps-clip-c (dual-clip PPO) must be > 1, got {dual}")
    return low, float(low if high is None else high), None if dual is None else float(dual)


def icepop_gate_weights(gate_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                        loss_mask: Optional[torch.Tensor], gate_low: float, gate_high: float
                        ) -> torch.Tensor:
    """Per-token IcePop weight ``w = k * 1[lo <= k <= hi] * m`` with ``k = exp(x - rollout)``.

    Computed by the ``icepop_loss`` kernel itself (no second copy of the gate's clamping and
    NaN rules): in decoupled mode with ``old_logprobs = logprobs = x`` and advantage 1 the
    ratio r is exactly 1, so the per-token loss is ``-w``. fp32 [N], no gradient.
    """
    x = gate_logprobs.detach().float()
    ones = torch.ones_like(x)
    per_token = icepop_loss(x, rollout_logprobs.detach(), ones, loss_mask, old_logprobs=x,
                            gate_low=gate_low, gate_high=gate_high, reduction="none")
    return -per_token


def _context_parallel(args) -> bool:
    return int(getattr(args, "context_parallel_size", 1)) > 1 or bool(getattr(args, "allgather_cp",
                                                                             False))


def _response_logprobs(args, batch, logits: torch.Tensor
                       ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """log pi_theta and the entropy of every response position, one fp32 tensor per sample, in
    slime's layout: [R_i] at CP = 1; under CP this rank's zigzag part of the response (chunks r
    and 2cp-1-r, the order of slime's ``slice_log_prob_with_cp`` and CP ``sum_of_sample_mean``).
    """
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must be slime's packed [1, T, V] tensor, got shape "
                         f"{tuple(logits.shape)}")
    temperature = float(getattr(args, "rollout_temperature", 1.0))
    tp_group = None
    if int(getattr(args, "tensor_model_parallel_size", 1)) > 1:
        from megatron.core import mpu  # only inside a Megatron run
        tp_group = mpu.get_tensor_model_parallel_group()
    kwargs = {"temperature": temperature, "return_entropy": True}
    if tp_group is not None:
        kwargs["tp_group"] = tp_group   # logits are this rank's vocab shard
    top_p = _slime_topp.top_p_enabled(args)
    row_index = None            # the response rows of the stream, when it is computed whole
    if _context_parallel(args):
        # The CP layout is slime's own: its slicer yields this rank's response rows per sample
        # (zigzag chunks; with --allgather-cp a contiguous slice of the global stream).
        from slime.backends.megatron_utils.loss import get_responses
        chunks = list(get_responses(
            logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
            total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"],
            apply_temperature=False))
        picked = torch.cat([c for c, _ in chunks]) if chunks else logits[0, :0]
        targets = torch.cat([t.to(logits.device).long() for _, t in chunks]) if chunks else \
            torch.zeros(0, dtype=torch.long, device=logits.device)
        sizes = [int(c.shape[0]) for c, _ in chunks]
        if top_p:
            kwargs["keep_token_ids"], kwargs["keep_offsets"] = _slime_topp.nucleus_csr(
                batch, [t for _, t in chunks], logits.device,
                positions=_slime_topp.cp_response_positions(args, batch, logits.shape[1]))
    else:
        flat = logits.reshape(logits.shape[1], logits.shape[2])   # a view: no copy backward
        rows, target_list, sizes, end = [], [], [], 0
        for tokens, total, resp in zip(batch["unconcat_tokens"], batch["total_lengths"],
                                       batch["response_lengths"]):
            end += int(total)
            # Position t predicts token t + 1: the response [end - R, end) comes from rows
            # [end - R - 1, end - 1) of the packed stream.
            rows.append(torch.arange(end - resp - 1, end - 1, device=flat.device))
            target_list.append(tokens[-resp:] if resp else tokens[:0])
            sizes.append(int(resp))
        if end > flat.shape[0]:
            raise ValueError(f"total_lengths sum to {end} but logits hold {flat.shape[0]} "
                             f"positions")
        row_index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long,
                                                             device=flat.device)
        targets = torch.cat(target_list).to(flat.device).long() if target_list else \
            torch.zeros(0, dtype=torch.long, device=flat.device)
        keep = _slime_topp.nucleus_csr(batch, target_list, flat.device) if top_p else None
        # Mostly response rows (the usual RL micro-batch): every row of the stream, as slime
        # does, prompt / padding rows with target 0 and no gradient. A copy of the response
        # rows would cost an [N, V] copy forward and a zero-filled [T, V] plus a scatter
        # backward; it only pays when prompts are the larger part.
        if 2 * row_index.numel() >= flat.shape[0]:
            stream_targets = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
            stream_targets[row_index] = targets
            if keep is not None:
                keep = (keep[0], _stream_offsets(keep[1], row_index, flat.shape[0]))
            picked, targets = flat, stream_targets
        else:
            picked, row_index = flat.index_select(0, row_index), None
        if keep is not None:  # slime renormalises the log-probs over the rollout's nucleus
            kwargs["keep_token_ids"], kwargs["keep_offsets"] = keep
    # One fused call (one set of TP all-reduces) for every response row of the micro-batch.
    lp, entropy = selective_logprobs(picked, targets, **kwargs)
    if row_index is not None:
        lp, entropy = lp.index_select(0, row_index), entropy.index_select(0, row_index)
    lp_list, entropy_list = list(lp.split(sizes)), list(entropy.split(sizes))
    if getattr(args, "allgather_cp", False):
        # slime's loss inputs (rollout log-probs, advantages) and its CP reducer are in the
        # zigzag layout; it moves the contiguous allgather-CP slices there with a differentiable
        # all-reduce over the CP group, as its own get_log_probs_and_entropy does.
        from slime.backends.megatron_utils.loss import _allgather_cp_redistribute
        res = {"log_probs": lp_list, "entropy": entropy_list}
        _allgather_cp_redistribute(res, logits_local_len=logits.shape[1],
                                   total_lengths=batch["total_lengths"],
                                   response_lengths=batch["response_lengths"])
        lp_list, entropy_list = res["log_probs"], res["entropy"]
    return lp_list, entropy_list


def _stream_offsets(offsets: torch.Tensor, row_index: torch.Tensor, rows: int) -> torch.Tensor:
    """CSR offsets over the response rows -> over every stream row (the others keep no
    nucleus); ``row_index`` is increasing, so the ids keep their order."""
    counts = torch.zeros(rows, dtype=offsets.dtype, device=offsets.device)
    counts[row_index] = offsets.diff()
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0))


def _local_loss_masks(args, batch) -> List[torch.Tensor]:
    """``batch["loss_masks"]`` stay full [R_i] under CP (slime's reducer slices them itself);
    the per-token inputs are this rank's zigzag part, so slice the masks the same way."""
    if not _context_parallel(args):
        return batch["loss_masks"]
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    return [slice_log_prob_with_cp(m, int(total), int(resp)) for m, total, resp in zip(
        batch["loss_masks"], batch["total_lengths"], batch["response_lengths"])]


def _cat(xs, device) -> torch.Tensor:
    return torch.cat([torch.as_tensor(x, device=device).float().reshape(-1) for x in xs])


def icepop_loss_function(args, batch: Dict, logits: torch.Tensor,
                         sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor]
                         ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """slime custom loss: IcePop on log-probs computed from ``logits`` by glm_kernels.

    Parameters (as slime passes them)
    ----------
    args : slime's argument namespace. Read: ``use_rollout_logprobs`` (coupled mode, no
        recomputed old log-probs), ``tis_clip_low`` / ``tis_clip`` (gate), ``eps_clip`` /
        ``eps_clip_high`` (PPO clip), ``eps_clip_c`` (dual clip for A < 0, as slime's
        ``compute_policy_loss``), ``rollout_temperature``, ``tensor_model_parallel_size``,
        ``context_parallel_size``, ``calculate_per_token_loss``, ``entropy_coef``.
    batch : dict of per-sample lists for one micro-batch: ``unconcat_tokens`` [total_i] int64,
        ``total_lengths`` / ``response_lengths`` ints, ``loss_masks`` [R_i] int,
        ``advantages`` [R_i] fp32, ``rollout_log_probs`` [R_i] fp32, optionally ``log_probs``
        [R_i] (recomputed old policy; switches to decoupled IcePop unless
        ``use_rollout_logprobs``) and ``teacher_log_probs`` [R_i] (logged as OPD reverse KL).
    logits : [1, T, V] fp32, or [1, T, V / tp] under tensor parallelism. Under context
        parallelism this rank's part of the stream, and ``rollout_log_probs``, ``advantages``,
        ``log_probs``, ``teacher_log_probs`` this rank's part of each response (slime's
        zigzag ``slice_log_prob_with_cp``) while ``loss_masks`` stay whole, as slime passes them.
    sum_of_sample_mean : slime's reducer: per-token [sum R_i] -> sum over samples of the
        masked sample mean (or the per-token sum when ``--calculate-per-token-loss``).

    Returns
    -------
    (loss, metrics): scalar ``pg_loss - entropy_coef * entropy_loss`` with gradient to
    ``logits``; metrics of 0-dim detached tensors, each a sum over samples that slime divides
    by the step's sample count: ``loss``, ``pg_loss``, ``entropy_loss``, ``pop_frac``,
    ``clip_frac``, ``train_rollout_logprob_abs_diff``, the token-level mismatch metrics of
    ``icepop_loss`` under verl's names (``TOKEN_MISMATCH_KEYS``: kl, k3_kl, chi2_token, the
    IcePop gate's rollout_is_mean / fraction_high / fraction_low / oob_ratio, nonfinite_frac:
    the micro-batch means times the micro-batch's sample count, or token count with
    ``--calculate-per-token-loss``, split over CP ranks like clip_frac), ``log_ppl_diff``
    (slime's per-sample mean of log pi_rollout - log pi_train over finite tokens = verl's
    per-sequence log_ppl_diff; train = the recomputed old log-probs when decoupled) and
    ``opd_reverse_kl`` when the batch carries teacher log-probs.
    """
    if getattr(args, "use_kl_loss", False):
        raise ValueError("icepop_loss_function has no reference-KL term; for --use-kl-loss use "
                         "--custom-loss-function-path glm_kernels.integrations.slime_policy."
                         "policy_loss_function with --use-tis --custom-tis-function-path "
                         "glm_kernels.integrations.slime.icepop_tis_function")
    for key in ("unconcat_tokens", "total_lengths", "response_lengths", "loss_masks",
                "advantages", "rollout_log_probs"):
        if not batch.get(key):
            raise ValueError(f"icepop_loss_function: batch[{key!r}] is missing or empty "
                             f"(slime provides it for policy training)")
    device = logits.device
    lp_list, entropy_list = _response_logprobs(args, batch, logits)
    logprobs, entropy = torch.cat(lp_list), torch.cat(entropy_list)
    rollout = _cat(batch["rollout_log_probs"], device)
    advantages = _cat(batch["advantages"], device)
    mask = _cat(_local_loss_masks(args, batch), device)
    if not (logprobs.shape == rollout.shape == advantages.shape == mask.shape):
        raise ValueError(f"per-token lengths disagree: log-probs {tuple(logprobs.shape)}, "
                         f"rollout_log_probs {tuple(rollout.shape)}, advantages "
                         f"{tuple(advantages.shape)}, loss_masks {tuple(mask.shape)}")
    old = None
    if not getattr(args, "use_rollout_logprobs", False) and batch.get("log_probs"):
        old = _cat(batch["log_probs"], device)          # decoupled: gate on exp(old - rollout)
    gate_low, gate_high = _gate_bounds(args)
    eps_low, eps_high, dual_clip = _clip_eps(args)
    per_token, m = icepop_loss(logprobs, rollout, advantages, mask, old_logprobs=old,
                               gate_low=gate_low, gate_high=gate_high, eps_low=eps_low,
                               eps_high=eps_high, dual_clip=dual_clip, reduction="none",
                               return_metrics=True)
    pg_loss = sum_of_sample_mean(per_token)
    entropy_loss = sum_of_sample_mean(entropy)
    entropy_coef = float(getattr(args, "entropy_coef", 0.0))
    loss = pg_loss - entropy_coef * entropy_loss if entropy_coef else pg_loss
    if logprobs.numel() == 0:            # keep every rank's graph connected (as slime does)
        loss = loss + 0.0 * logits.sum()
    weights = icepop_gate_weights(old if old is not None else logprobs, rollout, mask,
                                  gate_low, gate_high)
    popped = ((weights == 0) & (mask != 0)).float()
    # clip_frac is the kernel's fraction over this rank's masked tokens. slime sums every
    # metric over the micro-batches and the DP x CP ranks, then divides by the step's samples
    # (or tokens): report the clipped count (per-token loss), or the micro-batch fraction times
    # its sample count, split over the CP ranks in proportion to their clipped tokens.
    weight = (mask != 0).sum().clamp(min=1)
    if not getattr(args, "calculate_per_token_loss", False):
        full_masked = (_cat(batch["loss_masks"], device) != 0).sum().clamp(min=1)
        weight = weight * len(batch["response_lengths"]) / full_masked
    clip_metric = m["clip_frac"] * weight
    metrics = {
        "loss": loss.detach().clone(),
        "pg_loss": pg_loss.detach().clone(),
        "entropy_loss": entropy_loss.detach().clone(),
        "pop_frac": sum_of_sample_mean(popped).detach(),
        "clip_frac": clip_metric.detach(),
        "train_rollout_logprob_abs_diff":
            sum_of_sample_mean((logprobs.detach() - rollout).abs()).detach(),
    }
    # The token-level mismatch metrics are micro-batch means, weighted like clip_frac so that
    # slime's sum / samples (or / tokens) gives their sample- (token-) weighted average
    # (a NaN mean over no tokens counts 0). The per-sequence gap is slime's own per-sample
    # mean: sum_of_sample_mean of log pi_rollout - log pi_train (train = old when decoupled);
    # the other per-sequence metrics need whole samples, which a CP rank does not hold.
    for key in TOKEN_MISMATCH_KEYS:
        metrics[key] = (torch.nan_to_num(m[key], nan=0.0) * weight).detach()
    # In fp64: a signed near-zero sum, so CP ranks' parts add up to the single-rank value.
    train = (old if old is not None else logprobs.detach()).double()
    finite = torch.isfinite(train) & torch.isfinite(rollout)
    metrics["log_ppl_diff"] = sum_of_sample_mean(
        torch.where(finite, rollout.double() - train, 0.0)).float().detach()
    if batch.get("teacher_log_probs"):
        teacher = _cat(batch["teacher_log_probs"], device)
        metrics["opd_reverse_kl"] = sum_of_sample_mean(logprobs.detach() - teacher).detach()
    return loss, metrics


def icepop_tis_function(args, *, pg_loss: torch.Tensor, train_log_probs: List[torch.Tensor],
                        rollout_log_probs: List[torch.Tensor], loss_masks: List[torch.Tensor],
                        **kwargs) -> Tuple[torch.Tensor, List[torch.Tensor],
                                           Dict[str, torch.Tensor]]:
    """slime TIS hook: IcePop's gate on the recomputed-vs-rollout mismatch.

    slime's ``pg_loss`` [N] is already the clipped PPO term on r = exp(logprobs - old); this
    multiplies it by ``w = k * 1[lo <= k <= hi]`` with k = exp(old - rollout), which makes
    the whole term docs/design.md 3.1's decoupled IcePop. Popped tokens contribute exactly 0 (also
    when their ``pg_loss`` is inf or NaN) and stay in the denominators (``loss_masks`` are
    returned unchanged). Metrics are per-token tensors that slime reduces with its
    ``sum_of_sample_mean``: ``tis`` (the weight w), ``tis_pop`` (1 where popped) and
    ``tis_abs`` (|k - 1| on kept tokens).
    """
    if not (len(train_log_probs) == len(rollout_log_probs) == len(loss_masks)):
        raise ValueError(f"train_log_probs, rollout_log_probs and loss_masks must list the same "
                         f"samples, got {len(train_log_probs)}, {len(rollout_log_probs)}, "
                         f"{len(loss_masks)}")
    device = pg_loss.device
    old = _cat(train_log_probs, device)
    rollout = _cat(rollout_log_probs, device)
    # Under CP slime passes the full [R_i] loss_masks with this rank's part of everything else.
    mask_shape = old.shape if _context_parallel(args) else _cat(loss_masks, device).shape
    if not (old.shape == rollout.shape == mask_shape == pg_loss.shape):
        raise ValueError(f"per-token lengths disagree: pg_loss {tuple(pg_loss.shape)}, "
                         f"train_log_probs {tuple(old.shape)}, rollout_log_probs "
                         f"{tuple(rollout.shape)}, loss_masks {tuple(mask_shape)}")
    gate_low, gate_high = _gate_bounds(args)
    w = icepop_gate_weights(old, rollout, None, gate_low, gate_high)
    kept = w != 0
    weighted = torch.where(kept, pg_loss * w.to(pg_loss.dtype), torch.zeros_like(pg_loss))
    metrics = {"tis": w, "tis_pop": (~kept).float(),
               "tis_abs": torch.where(kept, (w - 1.0).abs(), torch.zeros_like(w))}
    return weighted, loss_masks, metrics


def opd_log_ratio_advantages(args, rollout_data: Dict) -> None:
    """slime custom advantages for on-policy distillation, GLM-5 form: A_t = sg(log pi_T -
    log pi_S) per response token (``opd_advantages(form="log_ratio")``), no outcome reward.

    The student log-probs are ``rollout_log_probs`` with ``--use-rollout-logprobs``, else the
    trainer's recomputed ``log_probs``; the teacher's come from ``--use-opd`` (``--opd-type
    sglang`` or ``megatron``). slime adds ``-opd_kl_coef * (student - teacher)`` after this
    hook when ``--use-opd`` is on, so ``--opd-kl-coef`` must be 0 (checked).
    """
    if getattr(args, "use_opd", False) and float(getattr(args, "opd_kl_coef", 0.0)) != 0.0:
        raise ValueError(f"opd_log_ratio_advantages sets the whole OPD advantage; pass "
                         f"--opd-kl-coef 0 (got {args.opd_kl_coef}) so slime does not add its "
                         f"own KL penalty on top")
    key = "rollout_log_probs" if getattr(args, "use_rollout_logprobs", False) else "log_probs"
    student = rollout_data.get(key)
    teacher = rollout_data.get("teacher_log_probs")
    if not student:
        raise ValueError(f"opd_log_ratio_advantages: rollout_data[{key!r}] is missing "
                         f"(student log-probs)")
    if not teacher:
        raise ValueError("opd_log_ratio_advantages: rollout_data['teacher_log_probs'] is "
                         "missing; enable --use-opd with --opd-type sglang or megatron")
    if len(student) != len(teacher):
        raise ValueError(f"{len(student)} student and {len(teacher)} teacher samples")
    advantages = []
    for s, t in zip(student, teacher):
        t = torch.as_tensor(t, device=s.device)
        advantages.append(opd_advantages(s.float(), t.float(), form="log_ratio"))
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = list(advantages)
