"""MuonSplit: Muon for hidden matrices (per head for MLA up-projections), AdamW for the rest.

Muon update of a matrix parameter p with gradient g (per block when the group has a
``head_split``; Moonlight's conventions)::

    M <- momentum * M + g
    U  = g + momentum * M            (nesterov, in fp32)   or   U = M
    O  = NS(U) * rms_scale * sqrt(max(rows, cols))          for every block of U
    p <- p * (1 - lr * weight_decay) - lr * O

NS is :func:`glm_kernels.muon.newton_schulz` (``ns_steps`` steps; a group may set
``ns_coefficients`` and ``ns_method``). Every block of every parameter of a group goes into
ONE batched Newton-Schulz call (one launch per matrix product on GPU). A 3-D parameter is a
stack of matrices [E, rows, cols] (transformers' MoE experts: ``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]): each of its E matrices is orthogonalized and scaled on its own, in
the same batched call, never the flattened [E, rows * cols] matrix. Parameters with 4 or more
dims (convolution kernels) are treated as [shape[0], prod(rest)].

AdamW (decoupled weight decay, bias-corrected, as torch.optim.AdamW) for groups with
``use_muon=False``; their learning rate is the group's ``lr``, which defaults to
``adamw_lr`` (or ``lr`` when ``adamw_lr`` is None).

Sharded parameters (FSDP2 ``fully_shard``, DTensor ``Shard(0)`` or ``Replicate()`` on a 1-D
mesh): state stays sharded like the parameter, AdamW runs on the local shards, and Muon groups
go through ``sharded.sharded_muon_step`` -- whole heads inside a shard are orthogonalized
locally, everything else once by an owner rank -- with results bitwise equal to one process.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import _checks, _dispatch
from .coefficients import resolve_coefficients
from .momentum import momentum_update
from .ns import METHODS, NSConfig, head_block_views, orthogonalize
from .sharded import is_dtensor, local, shard_like, sharded_muon_step
from .split import HeadSplit, PRESETS, head_splits_from_config

_MLA_NAMES = ("q_b_proj", "kv_b_proj", "linear_q_up_proj", "linear_kv_up_proj")
OUTPUT_HEAD_NAMES = ("lm_head", "output_layer", "embed_out")


def _as_head_split(value, where: str) -> Optional[HeadSplit]:
    if value is None or isinstance(value, HeadSplit):
        return value
    if isinstance(value, dict) and set(value) == {"num_heads", "block_rows"}:
        return HeadSplit(value["num_heads"], tuple(value["block_rows"]))
    if isinstance(value, (tuple, list)) and len(value) == 2:
        heads, rows = value
        return HeadSplit(heads, tuple([rows] if isinstance(rows, int) else rows))
    raise TypeError(f"{where} must be a HeadSplit, (num_heads, block_rows) or None, got "
                    f"{value!r}")


def _check_ns_steps(name: str, value) -> None:
    # 0 steps would only normalize the momentum (no orthogonalization: not Muon), so the
    # optimizer refuses it; newton_schulz(steps=0) stays available as a building block.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class MuonSplit(torch.optim.Optimizer):
    """Muon (per-head "Muon Split" for MLA projections) + AdamW, one ``torch.optim.Optimizer``.

    Parameters
    ----------
    params : iterable of Tensors or of dicts (param groups)
        Groups may set ``use_muon`` (default: True when every parameter has >= 2 dims, False
        when none has; mixed groups are an error), ``head_split`` (a HeadSplit or
        (num_heads, block_rows); tensor-parallel shards holding whole heads are recognized
        from their row count), ``ns_coefficients`` ("jordan", "polar_express" or a list),
        ``ns_method`` ("standard" or "gram"), and any of the hyper-parameters below.
        :func:`muon_param_groups` builds them from a model.
    lr : float
        Muon learning rate (and AdamW's when ``adamw_lr`` is None).
    momentum, nesterov, ns_steps, rms_scale
        Muon momentum (0.95), Nesterov (True), Newton-Schulz steps (5), update RMS scale
        (0.2: O is scaled by rms_scale * sqrt(max(rows, cols)) of its block).
    weight_decay : float, default 0.1
        Decoupled: p <- p * (1 - lr * weight_decay), Muon and AdamW groups alike.
    adamw_betas, adamw_eps, adamw_lr
        AdamW's (0.9, 0.95), 1e-8 and learning rate (default: ``lr``).

    Sharded training: parameters may be DTensors (FSDP2 ``fully_shard``, ``Shard(0)`` or
    ``Replicate()`` on a 1-D mesh, or HSDP's ``(Replicate(), Shard(0))`` on a 2-D mesh); build
    the groups with ``muon_param_groups`` after ``fully_shard``. Every rank must call
    ``step()`` (Muon groups exchange rows with ``all_to_all_single`` when a matrix or head
    spans shards). ``comm_stats`` holds the bytes this rank sent and received and the
    collectives of the last step. See docs/muon.md,
    "Sharded training".

    Example
    -------
    >>> import torch
    >>> from glm_kernels.optim import MuonSplit, muon_param_groups
    >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8))
    >>> opt = MuonSplit(muon_param_groups(model), lr=0.02, adamw_lr=3e-4)
    >>> model(torch.tensor([1, 2])).sum().backward(); opt.step()
    >>> [g["use_muon"] for g in opt.param_groups]
    [True, False, False]
    """

    def __init__(self, params, lr: float, *, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, rms_scale: float = 0.2, weight_decay: float = 0.1,
                 adamw_betas: Tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_lr: Optional[float] = None):
        check = _checks.check_finite_number
        lr = check("lr", lr, nonnegative=True)
        momentum = check("momentum", momentum, nonnegative=True)
        if momentum >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        _check_ns_steps("ns_steps", ns_steps)
        betas = tuple(check(f"adamw_betas[{i}]", b, nonnegative=True)
                      for i, b in enumerate(adamw_betas))
        if len(betas) != 2 or any(b >= 1 for b in betas):
            raise ValueError(f"adamw_betas must be two numbers in [0, 1), got {adamw_betas}")
        self._adamw_lr = None if adamw_lr is None else check("adamw_lr", adamw_lr,
                                                             nonnegative=True)
        defaults = dict(lr=lr, momentum=momentum,
                        nesterov=_checks.check_bool("nesterov", nesterov), ns_steps=ns_steps,
                        rms_scale=check("rms_scale", rms_scale, nonnegative=True),
                        weight_decay=check("weight_decay", weight_decay, nonnegative=True),
                        betas=betas, eps=check("adamw_eps", adamw_eps, positive=True),
                        head_split=None, ns_coefficients="jordan", ns_method="standard")
        super().__init__(params, defaults)
        # Tuning of the Triton Newton-Schulz path (operand dtype, tiles); the default is the
        # contract's bf16 operands with fp32 accumulation. The torch path always runs fp32.
        self.ns_config = NSConfig()
        self.comm_stats = {"bytes_sent": 0, "bytes_received": 0, "collectives": 0}

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group["params"] = params                  # a generator is read once
        where = f"param group {len(self.param_groups)}"
        if "use_muon" not in param_group:
            dims = {p.dim() >= 2 for p in params}
            if len(dims) > 1:
                raise ValueError(f"{where} mixes matrices and vectors: set use_muon, or build "
                                 "the groups with muon_param_groups(model)")
            param_group["use_muon"] = dims == {True} or not params
        use_muon = _checks.check_bool(f"{where} use_muon", param_group["use_muon"])
        if "nesterov" in param_group:
            _checks.check_bool(f"{where} nesterov", param_group["nesterov"])
        if not use_muon and "lr" not in param_group and self._adamw_lr is not None:
            param_group["lr"] = self._adamw_lr
        if "ns_steps" in param_group:
            _check_ns_steps(f"{where} ns_steps", param_group["ns_steps"])
        split = _as_head_split(param_group.get("head_split"), f"{where} head_split")
        param_group["head_split"] = split
        if use_muon:
            for i, p in enumerate(params):
                if p.dim() < 2:
                    raise ValueError(f"{where} has use_muon=True but parameter {i} has shape "
                                     f"{tuple(p.shape)}: Muon needs matrices")
                if split is not None and p.dim() == 3:
                    raise ValueError(f"{where} has a head_split and a 3-D parameter {i} "
                                     f"{tuple(p.shape)}: a 3-D parameter is a stack of "
                                     "matrices orthogonalized one by one, with no head split")
                if split is not None:
                    split.for_rows(p.shape[0])          # raises unless whole heads
            resolve_coefficients(param_group.get("ns_coefficients", "jordan"), 1)
            _checks.check_choice("ns_method", param_group.get("ns_method", "standard"),
                                   METHODS)
        super().add_param_group(param_group)

    def state_dict(self):
        state = super().state_dict()
        for group in state["param_groups"]:
            if isinstance(group.get("head_split"), HeadSplit):
                group["head_split"] = group["head_split"].to_dict()   # plain data: weights_only
        return state

    def load_state_dict(self, state_dict) -> None:
        """Also loads an unsharded checkpoint into sharded parameters: a plain state tensor
        with the full shape of a DTensor parameter is cut to this rank's rows (no
        communication). The other way: ``sharded.full_state_dict(opt.state_dict())``."""
        super().load_state_dict(state_dict)
        for i, group in enumerate(self.param_groups):
            group["head_split"] = _as_head_split(group.get("head_split"),
                                                 f"param group {i} head_split")
            for p in group["params"]:
                if not is_dtensor(p):
                    continue
                for key, value in self.state.get(p, {}).items():
                    if torch.is_tensor(value) and not is_dtensor(value) and value.dim() \
                            and tuple(value.shape) == tuple(p.shape):
                        self.state[p][key] = shard_like(value, p)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.comm_stats = {"bytes_sent": 0, "bytes_received": 0, "collectives": 0}
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        if any(is_dtensor(p) for p in params):
            sharded_muon_step(group, params, self.state, self.comm_stats)
            return
        momentum = group["momentum"]
        schedule = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        by_device: Dict[torch.device, list] = defaultdict(list)
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("MuonSplit does not support sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            update = momentum_update(state["momentum_buffer"], p.grad, momentum,
                                     group["nesterov"])
            by_device[p.device].append((p, _matrices(update)))
        for entries in by_device.values():
            results = self._orthogonalize(entries, group, schedule)
            self._apply(entries, results, group)

    def _orthogonalize(self, entries, group: dict, schedule) -> List[torch.Tensor]:
        """NS of every block of every (param, update) entry, in ONE batched call; one result
        per block, in order. Subclasses that gather tensor-parallel shards first override it
        (integrations/megatron.py)."""
        sources = []
        for p, update in entries:
            if update.dim() == 3:               # a stack of matrices: one block each
                sources.append(update)
                continue
            split = self._head_split(group, p)
            local = None if split is None else split.for_rows(update.shape[0])
            sources += ([update[None]] if local is None else
                        head_block_views(update, local.num_heads, local.block_rows))
        backend = _dispatch.select_backend("muon_split", sources[0])
        return orthogonalize(sources, schedule, method=group["ns_method"], eps=1e-7,
                             config=self.ns_config, backend=backend)

    def _head_split(self, group: dict, p: torch.Tensor) -> Optional[HeadSplit]:
        """The HeadSplit of ``p``: its group's (a subclass may give one per parameter)."""
        return group["head_split"]

    def _update_scale(self, group: dict, p: torch.Tensor, block_shape) -> float:
        """The factor of O for one block: rms_scale * sqrt(max(rows, cols)) (overridable)."""
        return group["rms_scale"] * math.sqrt(max(block_shape))

    def _apply(self, entries, results, group) -> None:
        """p <- p (1 - lr wd) - lr * scale * O, block by block (scale: ``_update_scale``)."""
        lr, decay = group["lr"], 1.0 - group["lr"] * group["weight_decay"]
        position = 0
        for p, update in entries:
            split = None if update.dim() == 3 else self._head_split(group, p)
            local = None if split is None else split.for_rows(update.shape[0])
            matrix = _matrices(p) if p.is_contiguous() else None
            work = matrix if matrix is not None else _matrices(p).clone()
            work.mul_(decay)
            if work.dim() == 3:
                targets = [work]
            else:
                targets = ([work[None]] if local is None else
                           head_block_views(work, local.num_heads, local.block_rows))
            for target in targets:
                scale = self._update_scale(group, p, tuple(target.shape[-2:]))
                target.add_(results[position], alpha=-lr * scale)
                position += 1
            if matrix is None:
                p.copy_(work.view_as(p))

    def _adamw_step(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], 1.0 - group["lr"] * group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("MuonSplit does not support sparse gradients")
            state = self.state[p]
            if "step" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            # DTensors: the same elementwise math on the local shards (no DTensor dispatch)
            exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
            grad, p = local(p.grad), local(p)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias1 = 1 - beta1 ** state["step"]
            bias2 = 1 - beta2 ** state["step"]
            p.mul_(decay)
            denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-lr / bias1)


def _matrices(t: torch.Tensor) -> torch.Tensor:
    """The matrices Muon orthogonalizes: a 3-D tensor as is (a stack [E, rows, cols]), any
    other as [shape[0], prod(rest)] (a view where the layout allows)."""
    return t if t.dim() == 3 else t.reshape(t.shape[0], -1)


# ---------------------------------------------------------------------- routing
def _matches(name: str, key: str) -> bool:
    """key is the full parameter name, a dotted suffix of it, or one of its components."""
    return name == key or name.endswith("." + key) or key in name.split(".")


def _resolve_head_splits(model, head_splits) -> Dict[str, HeadSplit]:
    if head_splits is None:
        return {}
    if isinstance(head_splits, str):
        if head_splits in PRESETS:
            return dict(PRESETS[head_splits])
        if head_splits != "auto":
            raise ValueError(f"head_splits={head_splits!r}: expected 'auto', one of "
                             f"{sorted(PRESETS)}, a dict or None")
        from_config = head_splits_from_config(getattr(model, "config", None))
        if from_config is not None:
            return from_config
        names = [n for n, p in model.named_parameters() if p.dim() >= 2
                 and any(_matches(n, key) for key in _MLA_NAMES)]
        if names:
            raise ValueError(f"head_splits='auto' found MLA projections ({names[0]}, ...) but "
                             "no MLA config on model.config: pass head_splits='glm5', "
                             "mla_head_splits(...) or a dict")
        return {}
    if not isinstance(head_splits, dict):
        raise TypeError(f"head_splits must be 'auto', a preset name, a dict or None, got "
                        f"{type(head_splits).__name__}")
    return {key: _as_head_split(value, f"head_splits[{key!r}]")
            for key, value in head_splits.items()}


def muon_param_groups(model: torch.nn.Module, head_splits: Union[str, dict, None] = "auto", *,
                      output_head: str = "adamw",
                      output_head_names: Sequence[str] = OUTPUT_HEAD_NAMES,
                      decay_vectors: bool = False,
                      adamw_lr: Optional[float] = None) -> List[dict]:
    """Param groups for :class:`MuonSplit` by the Muon Split routing rules.

    * vectors and scalars (biases, RMSNorm / LayerNorm scales): AdamW, weight decay 0 unless
      ``decay_vectors``;
    * embeddings (parameters of modules whose class name contains "Embedding", and weights
      tied to them), MoE router weights (modules whose class name contains "Router":
      transformers' ``*TopkRouter`` / ``*TopKRouter`` / ``*HashRouter``) and the output head
      (modules named ``lm_head`` / ``output_layer`` /
      ``embed_out``; ``output_head="muon"`` sends it to Muon instead): AdamW;
    * MLA up-projections (and DSA indexer query projections) matched by ``head_splits``: Muon
      per head (one group per HeadSplit);
    * 3-D stacks of expert matrices ([E, rows, cols]): Muon per expert;
    * every other matrix: Muon.

    ``head_splits``: "auto" (from ``model.config``'s MLA fields, Hugging Face or Megatron
    names; no MLA projections -> no splits), "glm5" / "deepseek_v3" presets, None, or a dict
    from a parameter name, dotted suffix or module-name component (``"q_b_proj"``) to a
    HeadSplit or (num_heads, block_rows). Tensor-parallel shards are handled by MuonSplit.
    Each group carries ``param_names``. Empty groups are left out. ``adamw_lr`` (optional)
    is written into the AdamW groups as their ``lr``: needed where a wrapper fills every
    group's ``lr`` before MuonSplit sees it (``ZeroRedundancyOptimizer(groups,
    optimizer_class=MuonSplit, lr=..., adamw_lr=...)``). Call it after ``fully_shard``
    for FSDP2 models: the groups then hold the DTensor parameters.
    """
    _checks.check_choice("output_head", output_head, ("adamw", "muon"))
    _checks.check_bool("decay_vectors", decay_vectors)
    adamw = {} if adamw_lr is None else {
        "lr": _checks.check_finite_number("adamw_lr", adamw_lr, nonnegative=True)}
    splits = _resolve_head_splits(model, head_splits)
    embedding_ids = {id(p) for module in model.modules()
                     if "Embedding" in type(module).__name__
                     for p in module.parameters(recurse=False)}
    router_ids = {id(p) for module in model.modules() if "Router" in type(module).__name__
                  for p in module.parameters(recurse=False)}
    muon, adamw_params, vectors = [], [], []
    by_split: Dict[HeadSplit, list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module_path = name.split(".")[:-1]
        if p.dim() < 2:
            vectors.append((name, p))
        elif id(p) in embedding_ids or id(p) in router_ids:
            adamw_params.append((name, p))
        elif any(part in output_head_names for part in module_path) and output_head == "adamw":
            adamw_params.append((name, p))
        else:
            split = next((s for key, s in splits.items() if _matches(name, key)), None)
            (by_split.setdefault(split, []) if split is not None else muon).append((name, p))

    def group(entries, **options):
        return {"params": [p for _, p in entries], "param_names": [n for n, _ in entries],
                **options}
    groups = [group(muon, use_muon=True)] if muon else []
    groups += [group(entries, use_muon=True, head_split=split)
               for split, entries in by_split.items()]
    if adamw_params:
        groups.append(group(adamw_params, use_muon=False, **adamw))
    if vectors:
        groups.append(group(vectors, use_muon=False, **adamw,
                            **({} if decay_vectors else {"weight_decay": 0.0})))
    return groups
