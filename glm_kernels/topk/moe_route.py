"""DeepSeek-V3 / GLM-5 ``noaux_tc`` MoE routing in one deterministic kernel.

Math (readable version: ``topk/_reference.py:moe_route_reference``)::

    s = sigmoid(l)            (or softmax(l) over the experts, or DeepSeek-V4's
                               sqrt(softplus(l))), fp32
    c = s + bias              (the load-balancing bias steers the choice only)
    group score_g = sum of the two largest c in group g (n_group contiguous groups)
    eligible = experts of the topk_group best groups
    ids = top-k of c over eligible experts, in descending c
    w = s[ids] / (sum(s[ids]) + 1e-20) if renormalize else s[ids];   w *= scaling_factor

Every ranking (groups, experts) breaks ties toward the lower index, so the routing is a
fixed function of the logits: bitwise identical across runs and batch sizes. Weights are
differentiable in the logits (the choice itself is piecewise constant).

Rollout routing replay (R3): ``replay_ids`` makes the routing the recorded one (the choice is
skipped) and recomputes only the weights, with the same expression as above;
``return_mismatch=True`` also says, per token, whether the token's own choice would have
been a different set of experts (the routing mismatch rate is its mean).

Difference from HF ``DeepseekV3TopkRouter``: HF fills the experts of dropped groups with 0.0
before its top-k, so a dropped expert could beat a kept one whose biased score is negative;
here (as in DeepSeek's own inference code, which fills -inf) dropped experts are never chosen.
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from .. import _checks, _dispatch
from . import _reference

SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")
SCORING_CODES = {name: code for code, name in enumerate(SCORINGS)}   # the kernel's SCORING
RENORM_EPS = 1e-20
MAX_KERNEL_EXPERTS = 4096     # one token's experts are held in registers
MAX_KERNEL_GROUPS = 64


REPLAY_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class MoeRoute(NamedTuple):
    weights: torch.Tensor
    ids: torch.Tensor


class MoeReplay(NamedTuple):
    """``moe_route(..., replay_ids=..., return_mismatch=True)``: ``mismatch`` is bool [...],
    True where the token's own noaux_tc choice is a different expert set."""
    weights: torch.Tensor
    ids: torch.Tensor
    mismatch: torch.Tensor


@dataclass(frozen=True)
class MoeRouteConfig:
    """Tokens per program (power of two) and warps; ``make_moe_route_config`` picks them."""
    rows_per_program: int
    num_warps: int = 4


def make_moe_route_config(n_tokens: int, n_experts: int) -> MoeRouteConfig:
    block = _dispatch.next_power_of_2(n_experts)
    rows = max(1, min(_dispatch.next_power_of_2(n_tokens), 2048 // block))
    return MoeRouteConfig(rows_per_program=rows, num_warps=4 if rows * block <= 2048 else 8)


def _scores(logits2d: torch.Tensor, scoring: str) -> torch.Tensor:
    return _reference.router_scores(logits2d.float(), scoring)


def _check_replay_values(replay2d: torch.Tensor, n_experts: int) -> None:
    """Range and per-token duplicates of replay ids (one host sync; inside the op, so
    ``torch.compile`` sees no data-dependent branch)."""
    if replay2d.numel() == 0:
        return
    ordered = replay2d.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
    first_repeat = torch.where(repeated, torch.arange(len(repeated), device=repeated.device),
                               len(repeated)).min()
    low, high, token = torch.stack([ordered[:, 0].min().long(), ordered[:, -1].max().long(),
                                    first_repeat.long()]).tolist()
    if low < 0 or high >= n_experts:
        raise ValueError(f"replay_ids must lie in [0, {n_experts}) (n_experts), got values in "
                         f"[{low}, {high}]")
    if token < len(repeated):
        raise ValueError(f"replay_ids must list k distinct experts per token; token "
                         f"{token} has {replay2d[token].tolist()}")


def _route_rows(logits2d, k, scoring, bias, n_group, topk_group, renormalize, scaling_factor,
                rows_per_program, num_warps, replay2d=None, return_mismatch=False):
    """(weights fp32 [T, k], ids int64 [T, k], mismatch bool [T] or [0] when not asked)."""
    n_tokens, n_experts = logits2d.shape
    if replay2d is not None:
        _check_replay_values(replay2d, n_experts)
    mismatch = torch.empty((n_tokens if return_mismatch else 0,), dtype=torch.bool,
                           device=logits2d.device)
    backend = _dispatch.select_backend("moe_route", logits2d, bias, replay2d)
    if backend != "torch" and (n_experts > MAX_KERNEL_EXPERTS or n_group > MAX_KERNEL_GROUPS):
        _dispatch.warn_once("fallback:moe_route:size",
                            f"glm_kernels.moe_route: {n_experts} experts / {n_group} groups "
                            f"exceed the kernel's {MAX_KERNEL_EXPERTS} / {MAX_KERNEL_GROUPS}; "
                            "using the torch reference")
        backend = "torch"
    if backend == "torch" or n_tokens == 0:
        kwargs = dict(scoring=scoring, bias=bias, n_group=n_group, topk_group=topk_group,
                      renormalize=renormalize, scaling_factor=scaling_factor, eps=RENORM_EPS)
        with torch.no_grad():
            weights, ids = _reference.moe_route_reference(logits2d, k, replay_ids=replay2d,
                                                          **kwargs)
            if return_mismatch:
                own = _reference.moe_route_reference(logits2d, k, **kwargs)[1]
                mismatch = _reference.routing_mismatch_reference(own, ids)
        # A custom op's outputs may not alias its inputs (int64 replay ids come back as is),
        # and must have the fake's contiguous [T, k] strides: the reference's are views of
        # [T, n_experts] buffers, which Inductor's stride asserts reject.
        ids = ids.clone() if replay2d is not None and ids.data_ptr() == replay2d.data_ptr() \
            else ids.contiguous()
        return weights.contiguous(), ids, mismatch
    from . import _kernels
    weights = torch.empty((n_tokens, k), dtype=torch.float32, device=logits2d.device)
    ids = torch.empty((n_tokens, k), dtype=torch.int64, device=logits2d.device)
    flags = torch.empty((n_tokens,), dtype=torch.uint8, device=logits2d.device) \
        if return_mismatch else None
    _kernels.moe_route(logits2d, None if bias is None else bias.float().contiguous(),
                       replay2d, weights, ids, flags, k=k, scoring=SCORING_CODES[scoring],
                       n_group=n_group, topk_group=topk_group, renormalize=renormalize,
                       scaling_factor=scaling_factor, eps=RENORM_EPS,
                       rows_per_program=rows_per_program, num_warps=num_warps)
    return weights, ids, (flags.view(torch.bool) if return_mismatch else mismatch)


@torch.library.custom_op("glm_kernels::moe_route", mutates_args=())
def _moe_route_op(logits2d: torch.Tensor, k: int, scoring: str, bias: Optional[torch.Tensor],
                  n_group: int, topk_group: int, renormalize: bool, scaling_factor: float,
                  rows_per_program: int, num_warps: int, replay_ids: Optional[torch.Tensor],
                  return_mismatch: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _route_rows(logits2d, k, scoring, bias, n_group, topk_group, renormalize,
                       scaling_factor, rows_per_program, num_warps, replay_ids, return_mismatch)


@_moe_route_op.register_fake
def _moe_route_fake(logits2d, k, scoring, bias, n_group, topk_group, renormalize,
                    scaling_factor, rows_per_program, num_warps, replay_ids, return_mismatch):
    n_tokens = logits2d.shape[0]
    return (logits2d.new_empty((n_tokens, k), dtype=torch.float32),
            logits2d.new_empty((n_tokens, k), dtype=torch.int64),
            logits2d.new_empty((n_tokens if return_mismatch else 0,), dtype=torch.bool))


def _moe_route_setup_context(ctx, inputs, output):
    logits2d, _k, scoring, _bias, _ng, _tg, renormalize, scaling_factor = inputs[:8]
    ctx.save_for_backward(logits2d, output[1])
    ctx.scoring, ctx.renormalize, ctx.scaling_factor = scoring, renormalize, scaling_factor


def _moe_route_backward(ctx, grad_weights, _grad_ids, _grad_mismatch):
    """d/dl of w = c * s[ids] / (sum s[ids] + eps), with the chosen (or replayed) ids fixed."""
    logits2d, ids = ctx.saved_tensors
    scores = _scores(logits2d, ctx.scoring)
    chosen = scores.gather(1, ids)
    grad = grad_weights.float() * ctx.scaling_factor
    if ctx.renormalize:
        denom = chosen.sum(-1, keepdim=True) + RENORM_EPS
        grad = grad / denom - (grad * chosen).sum(-1, keepdim=True) / denom ** 2
    # ids are distinct within a row: the scatters have no conflicting writes.
    if ctx.scoring == "sigmoid":
        grad_logits = torch.zeros_like(scores).scatter(1, ids, grad * chosen * (1 - chosen))
    elif ctx.scoring == "sqrtsoftplus":
        # d sqrt(softplus(l)) / dl = sigmoid(l) / (2 sqrt(softplus(l)))
        slope = _reference.router_scores(logits2d.float().gather(1, ids), "sigmoid")
        slope = torch.where(chosen > 0, slope / (2 * chosen), torch.zeros_like(chosen))
        grad_logits = torch.zeros_like(scores).scatter(1, ids, grad * slope)
    else:
        grad_scores = torch.zeros_like(scores).scatter(1, ids, grad)
        grad_logits = scores * (grad_scores - (grad_scores * scores).sum(-1, keepdim=True))
    return (grad_logits.to(logits2d.dtype),) + (None,) * 11


torch.library.register_autograd("glm_kernels::moe_route", _moe_route_backward,
                                setup_context=_moe_route_setup_context)


def _check_replay_ids(replay_ids, router_logits, k, return_mismatch):
    """dtype, shape and device of replay_ids (values are checked inside the op)."""
    if replay_ids is None:
        if return_mismatch:
            raise ValueError("return_mismatch=True needs replay_ids: the mismatch compares the "
                             "token's own choice with the replayed one (compare two recorded "
                             "routings with glm_kernels.topk.routing_mismatch)")
        return
    _checks.check_tensor("replay_ids", replay_ids, dtypes=REPLAY_DTYPES)
    want = tuple(router_logits.shape[:-1]) + (k,)
    if tuple(replay_ids.shape) != want:
        raise ValueError(f"replay_ids must have shape {want} (router_logits' leading dims, "
                         f"k={k}), got shape {tuple(replay_ids.shape)}")
    _checks.check_same_device(dict(router_logits=router_logits, replay_ids=replay_ids))


def _check_route_inputs(router_logits, k, scoring, bias, n_group, topk_group):
    _checks.check_tensor("router_logits", router_logits,
                           dtypes=(torch.float32, torch.bfloat16, torch.float16))
    if router_logits.dim() == 0 or router_logits.shape[-1] == 0:
        raise ValueError(f"router_logits must be [..., n_experts] with n_experts >= 1, got "
                         f"shape {tuple(router_logits.shape)}")
    n_experts = router_logits.shape[-1]
    _checks.check_choice("scoring", scoring, SCORINGS)
    for name, value in (("k", k), ("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if n_experts % n_group:
        raise ValueError(f"n_group={n_group} must divide n_experts={n_experts}")
    if topk_group > n_group:
        raise ValueError(f"topk_group={topk_group} must be <= n_group={n_group}")
    eligible = topk_group * (n_experts // n_group)
    if k > eligible:
        raise ValueError(f"k={k} exceeds the {eligible} experts eligible after group "
                         f"limiting (topk_group {topk_group} x {n_experts // n_group} experts "
                         "per group)")
    if bias is not None:
        _checks.check_tensor("bias", bias, floating=True, ndim=(1,))
        if bias.shape[0] != n_experts:
            raise ValueError(f"bias must have shape [{n_experts}] (n_experts), got shape "
                             f"{tuple(bias.shape)}")
        _checks.check_same_device(dict(router_logits=router_logits, bias=bias))


def moe_route(router_logits: torch.Tensor, k: int, *, scoring: str = "sigmoid",
              bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
              renormalize: bool = True, scaling_factor: float = 1.0,
              replay_ids: Optional[torch.Tensor] = None, return_mismatch: bool = False,
              config: Optional[MoeRouteConfig] = None) -> MoeRoute:
    """DeepSeek-V3 / GLM-5 ``noaux_tc`` routing: group-limited, bias-steered, deterministic.

    Parameters
    ----------
    router_logits : Tensor [..., n_experts], float32 / bfloat16 / float16
        Gate logits (computed in fp32 inside). Leading dims are tokens.
    k : int
        Experts per token (GLM-5: 8 of 256). At most topk_group * n_experts / n_group.
    scoring : {"sigmoid", "softmax", "sqrtsoftplus"}, default "sigmoid"
        sigmoid 1 / (1 + exp(-l)); softmax over the experts; sqrtsoftplus (DeepSeek-V4)
        sqrt(log(1 + exp(l))). Each computed so a token's bits never depend on the batch.
    bias : Tensor [n_experts], float, optional
        ``e_score_correction_bias``: added to the scores for the choice only.
    n_group, topk_group : int, default 1, 1
        Experts form n_group contiguous groups; a group's score is the sum of its two
        largest biased scores; only the topk_group best groups' experts are eligible.
    renormalize : bool, default True
        Divide the k weights by their sum (+ 1e-20), as ``norm_topk_prob`` does (HF
        DeepSeek-V3, SGLang), for every k. With k = 1 the weight is then s / (s + 1e-20):
        exactly 1.0 (times ``scaling_factor``) whenever s >= ~1.7e-13 (fp32 s + 1e-20 == s;
        a sigmoid logit above about -29.4), a little below 1 under that, and the router gets
        no gradient through it. Megatron-Core (``topk_routing_with_score_function``)
        normalizes sigmoid scores only when topk > 1 and keeps the top-1 score s itself as the
        weight: pass ``renormalize=False`` to match it at k = 1. (Megatron's softmax without
        ``use_pre_softmax`` is a softmax over the top-k logits, 1.0 at top-1 as here.)
    scaling_factor : float, default 1.0
        ``routed_scaling_factor``, applied after renormalizing.
    replay_ids : Tensor [..., k], int64 / int32 / int16 / int8 / uint8, optional
        Rollout routing replay (R3): route every token to these experts (recorded by the
        rollout engine) instead of choosing; only the weights are computed, with the same
        expression as the normal path (bias and groups play no part). Each token's k ids
        must be distinct and in [0, n_experts) (checked: one host sync), else ValueError.
    return_mismatch : bool, default False
        With ``replay_ids`` only: also return ``mismatch``, bool [...], True where the
        token's own choice (computed in the same kernel, no extra read) is a different
        expert *set* than the replayed one. ``mismatch.float().mean()`` is the routing
        mismatch rate.
    config : MoeRouteConfig, optional
        Overrides ``make_moe_route_config``.

    Returns
    -------
    MoeRoute(weights, ids): fp32 weights and int64 expert ids, shape [..., k], ordered by
    descending biased score (ties: lower expert index); with ``replay_ids``, ids equal
    ``replay_ids`` (as int64, in their order) and weights[..., j] is the weight of
    ids[..., j]. Weights carry gradients to ``router_logits``. ``return_mismatch=True``
    returns MoeReplay(weights, ids, mismatch).

    Example
    -------
    >>> import torch
    >>> from glm_kernels.topk import moe_route
    >>> logits = torch.tensor([[0.0, 2.0, 2.0, -1.0, 1.0, 0.5, 3.0, 0.0]])
    >>> w, ids = moe_route(logits, 2, n_group=4, topk_group=2)
    >>> ids.tolist()    # groups (6, 7) and (0, 1) have the largest top-2 sums
    [[6, 1]]
    >>> round(w.sum().item(), 6)
    1.0
    >>> replayed = moe_route(logits, 2, n_group=4, topk_group=2,
    ...                      replay_ids=torch.tensor([[1, 6]]), return_mismatch=True)
    >>> replayed.ids.tolist(), replayed.mismatch.tolist()     # same set, other order
    ([[1, 6]], [False])
    >>> torch.equal(replayed.weights, w.flip(-1))
    True
    """
    _check_route_inputs(router_logits, k, scoring, bias, n_group, topk_group)
    renormalize = _checks.check_bool("renormalize", renormalize)
    return_mismatch = _checks.check_bool("return_mismatch", return_mismatch)
    _check_replay_ids(replay_ids, router_logits, k, return_mismatch)
    scaling_factor = _checks.check_finite_number("scaling_factor", scaling_factor)
    n_experts = router_logits.shape[-1]
    logits2d = router_logits.reshape(-1, n_experts)
    if logits2d.stride(-1) != 1 or (logits2d.shape[0] and logits2d.stride(0) < n_experts):
        logits2d = logits2d.contiguous()
    if config is None:
        config = make_moe_route_config(logits2d.shape[0], n_experts)
    if config.rows_per_program < 1 or config.rows_per_program & (config.rows_per_program - 1):
        raise ValueError(f"config.rows_per_program must be a power of two, got "
                         f"{config.rows_per_program}")
    replay2d = None if replay_ids is None else replay_ids.reshape(-1, k).contiguous()
    args = (logits2d, k, scoring, bias, n_group, topk_group, renormalize,
            scaling_factor, config.rows_per_program, config.num_warps, replay2d,
            return_mismatch)
    needs_graph = torch.compiler.is_compiling() or (
        router_logits.requires_grad and torch.is_grad_enabled())
    weights, ids, mismatch = _moe_route_op(*args) if needs_graph else _route_rows(*args)
    out_shape = router_logits.shape[:-1] + (k,)
    if return_mismatch:
        return MoeReplay(weights.reshape(out_shape), ids.reshape(out_shape),
                         mismatch.reshape(out_shape[:-1]))
    return MoeRoute(weights.reshape(out_shape), ids.reshape(out_shape))


def routing_mismatch(ids: torch.Tensor, other_ids: torch.Tensor) -> torch.Tensor:
    """Per token, whether two routings [..., k] send it to different expert *sets*.

    Parameters
    ----------
    ids, other_ids : Tensor [..., k], integer, same shape and device
        E.g. the trainer's own ``moe_route`` ids and the ids the rollout engine recorded.

    Returns
    -------
    Tensor [...], bool: True where the sets differ (order within a token does not count).
    ``.float().mean()`` is the routing mismatch rate. Plain torch ops on any device.

    Example
    -------
    >>> import torch
    >>> routing_mismatch(torch.tensor([[1, 6], [0, 2]]), torch.tensor([[6, 1], [0, 3]])).tolist()
    [False, True]
    """
    _checks.check_tensor("ids", ids, dtypes=REPLAY_DTYPES)
    _checks.check_tensor("other_ids", other_ids, dtypes=REPLAY_DTYPES)
    _checks.check_same_shape("other_ids", other_ids, "ids", ids)
    _checks.check_same_device(dict(ids=ids, other_ids=other_ids))
    if ids.dim() == 0:
        raise ValueError(f"ids must be [..., k], got shape {tuple(ids.shape)}")
    return _reference.routing_mismatch_reference(ids.to(torch.int64), other_ids)
