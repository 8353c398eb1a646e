"""Megatron-core plug-in: MuonSplit as one of Megatron's emerging optimizers.

Megatron-core (checked against 0.19.2) builds Muon through a registry of "emerging optimizers"
(``megatron/core/optimizer/emerging_optimizers.py``: ``_EMERGING_OPTIMIZERS``, name ->
``EmergingOptimizerEntry``); ``get_megatron_optimizer`` routes 2-D non-embedding, non-output
parameters to the registered class and the rest to Adam (the entry's
``default_param_overrides``), then wraps the result like its own Muon: ``FP32Optimizer`` /
``Float16OptimizerWithFloat16Params``, ``ChainedOptimizer``, or
``LayerWiseDistributedOptimizer`` (``use_layer_wise_distributed_optimizer=True``: whole
parameters per data-parallel rank, then a broadcast). :func:`register` adds one entry, so::

    from glm_kernels.integrations import megatron as glm_megatron
    glm_megatron.register()                       # once per process, before building
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon_split", ...), model)

Megatron's own knobs are read from ``OptimizerConfig``: ``muon_momentum``, ``muon_nesterov``,
``muon_num_ns_steps``, ``muon_coefficient_type`` (Megatron's coefficient table, as a MuonSplit
schedule), ``muon_scale_mode`` x ``muon_extra_scale_factor``, ``muon_fp32_matmul_prec`` (the
Newton-Schulz operand dtype), ``muon_tp_mode``; its scheduler sets ``lr`` and
``weight_decay`` on the groups. Weight decay is decoupled (p <- p (1 - lr wd)) whatever
``decoupled_weight_decay`` says, as in Megatron's Muon (0.19.2 reads that flag for Adam only:
``TensorParallelMuon``'s ``use_decoupled_weight_decay`` has no OptimizerConfig field and keeps
its default True).

``muon_split_qkv=True`` (Megatron's default) means the seed's per-head split, read from the
model's config:

* ``linear_qkv`` (GQA / MHA): per query group, each head's Q, then K and V (with
  ``attention_output_gate``: each head's Q, each head's gate, K, V) -- Megatron's own Muon
  splits it into three matrices Q, K, V over all heads instead;
* MLA ``linear_q_up_proj`` / ``linear_q_proj``: per head, [qk_head_dim | qk_pos_emb_head_dim];
  ``linear_kv_up_proj``: per head, [qk_head_dim (K nope) | v_head_dim] -- Megatron's Muon
  leaves them whole.

``muon_split_qkv=False``: every matrix whole, as Megatron's ``TensorParallelMuon``.

Tensor parallelism: a column-parallel shard of a head-split weight holds whole heads (local,
no communication, in every ``muon_tp_mode``). Other sharded matrices follow ``muon_tp_mode``:
``blockwise`` orthogonalizes each shard on its own (as Megatron); ``duplicated`` all-gathers
the update and every TP rank runs NS on the whole matrix; ``distributed`` gathers each matrix
on ONE owner rank of the TP group (round robin), which runs NS, and scatters the rows back --
both give what one process gives on the gathered weights.

Differences from ``TensorParallelMuon`` that do not change the update: MuonSplit keeps the
momentum as a sum (M <- mu M + g) where emerging-optimizers keeps an average
(M <- mu M + (1 - mu) g); Newton-Schulz normalizes its input, so the orthogonalized update is
the same up to fp32 rounding, but the saved ``momentum_buffer`` differs by the factor
(1 - mu). ``muon_fp32_matmul_prec="high"`` runs fp32 operands (the Triton path has no tf32
mode); ``"medium"`` is the library's bf16 operands with fp32 accumulation, as Megatron.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from .. import _checks
from ..muon.ns import NSConfig
from ..muon.optimizer import MuonSplit
from ..muon.split import HeadSplit, head_splits_from_config

__all__ = ["register", "MegatronMuonSplit", "coefficient_schedule", "model_head_splits",
           "OPTIMIZER_NAME", "INSTALL_HINT"]

OPTIMIZER_NAME = "muon_split"
INSTALL_HINT = ("pip install 'megatron-core==0.19.2' 'emerging-optimizers==0.3.0' "
                "(megatron-core 0.19 needs Python >= 3.12)")
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
TP_MODES = ("blockwise", "duplicated", "distributed")
# muon_fp32_matmul_prec -> Newton-Schulz operand dtype (None: the library's bf16 default).
OPERAND_DTYPES = {"medium": None, "high": torch.float32, "highest": torch.float32}
# emerging-optimizers' newton_schulz cycles through a coefficient table, except for these,
# which repeat their last entry (its ``repeat_last_types``, 0.3.0).
_REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
# Parameter-name endings of the attention projections that are split per head.
_QKV = "linear_qkv.weight"
_MLA_Q = ("linear_q_up_proj.weight", "linear_q_proj.weight")
_MLA_KV = "linear_kv_up_proj.weight"


def _emerging_module():
    try:
        from megatron.core.optimizer import emerging_optimizers
    except ImportError as exc:
        raise ImportError("glm_kernels.integrations.megatron needs megatron-core: "
                          f"{INSTALL_HINT}") from exc
    return emerging_optimizers


# --------------------------------------------------------------------------- config mapping
def coefficient_schedule(coefficient_type: str, steps: int):
    """Megatron's ``muon_coefficient_type`` as a MuonSplit ``ns_coefficients`` value.

    ``"simple"`` is the library's ``"jordan"`` (the same triple every step). The others are
    emerging-optimizers' own tables, laid out per step the way its ``newton_schulz`` walks
    them (cycling, or repeating the last entry), so both run the same polynomials. ``"custom"``
    has no table (Megatron's ``TensorParallelMuon`` cannot pass one either): a ValueError.
    """
    if not isinstance(coefficient_type, str):
        raise TypeError(f"muon_coefficient_type must be a str, got {coefficient_type!r}")
    if coefficient_type == "simple":
        return "jordan"
    try:
        from emerging_optimizers.orthogonalized_optimizers import muon_utils
    except ImportError as exc:
        raise ImportError(f"muon_coefficient_type={coefficient_type!r} reads emerging-"
                          f"optimizers' table: {INSTALL_HINT}") from exc
    tables = getattr(muon_utils, "_COEFFICIENT_SETS", {})
    if coefficient_type not in tables:
        raise ValueError(f"muon_coefficient_type={coefficient_type!r}: expected one of "
                         f"{['simple'] + sorted(k for k in tables if k != 'simple')}")
    mode = "repeat_last" if coefficient_type in _REPEAT_LAST else "cycle"
    return [tuple(float(v) for v in entry) for entry in
            muon_utils.get_coefficient_iterator(steps, tables[coefficient_type], mode=mode)]


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """emerging-optimizers' ``get_muon_scale_factor``: the update scale of a rows x cols matrix."""
    if mode == "spectral":                 # Moonlight / Kimi: sqrt(max(m, n))
        return math.sqrt(max(rows, cols))
    if mode == "shape_scaling":            # Keller Jordan's Muon
        return math.sqrt(max(1.0, rows / cols))
    return math.sqrt(rows / cols)          # unit_rms_norm (Scion)


def model_head_splits(model_chunks) -> Dict[int, HeadSplit]:
    """id(parameter) -> HeadSplit of every attention projection split per head.

    GQA / MHA ``linear_qkv``: HeadSplit(num_query_groups, [kv] * heads_per_group (Q)
    [+ [kv] * heads_per_group (gate)] + [kv, kv] (K, V)); MLA ``linear_q_up_proj`` /
    ``linear_q_proj``: HeadSplit(heads, [qk_head_dim, qk_pos_emb_head_dim]);
    ``linear_kv_up_proj``: HeadSplit(heads, [qk_head_dim, v_head_dim]). Sizes are global
    (the model config's); a tensor-parallel shard is recognized by MuonSplit from its rows.
    """
    splits: Dict[int, HeadSplit] = {}
    for chunk in model_chunks:
        config = getattr(chunk, "config", None)
        if config is None:
            raise ValueError(f"model chunk {type(chunk).__name__} has no .config: per-head "
                             "splits are read from Megatron's TransformerConfig")
        mla = head_splits_from_config(config) if getattr(config, "multi_latent_attention",
                                                         False) else None
        for name, p in chunk.named_parameters():
            if p.dim() != 2 or not p.requires_grad:
                continue
            if mla is not None and name.endswith(_MLA_Q):
                splits[id(p)] = mla["linear_q_up_proj"]
            elif mla is not None and name.endswith(_MLA_KV):
                splits[id(p)] = mla["linear_kv_up_proj"]
            elif mla is None and name.endswith(_QKV):
                splits[id(p)] = _qkv_split(config)
    return splits


def _qkv_split(config) -> HeadSplit:
    heads, groups = config.num_attention_heads, config.num_query_groups or \
        config.num_attention_heads
    kv = config.kv_channels or config.hidden_size // heads
    if heads % groups:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of "
                         f"num_query_groups={groups}")
    per_group = heads // groups
    gate = per_group if getattr(config, "attention_output_gate", False) else 0
    return HeadSplit(groups, (kv,) * (per_group + gate + 2))


def _config_to_kwargs(config, model_chunks, pg_collection) -> dict:
    """OptimizerConfig -> MegatronMuonSplit keyword arguments (every value checked here)."""
    if config.muon_scalar_optimizer != "adam":
        # Megatron rewrites the scalar optimizer only for its own "muon" names; this entry's
        # non-Muon parameters always go to Adam, so another choice would be ignored.
        raise ValueError(f"muon_scalar_optimizer={config.muon_scalar_optimizer!r}: "
                         f"optimizer={config.optimizer!r} routes non-matrix parameters to "
                         "Adam only (use muon_scalar_optimizer='adam')")
    split_qkv = _checks.check_bool("muon_split_qkv", config.muon_split_qkv)
    momentum = _checks.check_finite_number("muon_momentum", config.muon_momentum,
                                             nonnegative=True)
    if momentum >= 1:
        raise ValueError(f"muon_momentum must be in [0, 1), got {momentum}")
    return dict(
        lr=config.lr, weight_decay=config.weight_decay, momentum=momentum,
        nesterov=_checks.check_bool("muon_nesterov", config.muon_nesterov),
        num_ns_steps=config.muon_num_ns_steps,
        coefficients=coefficient_schedule(config.muon_coefficient_type,
                                          _ns_steps(config.muon_num_ns_steps)),
        scale_mode=config.muon_scale_mode,
        extra_scale_factor=_checks.check_finite_number(
            "muon_extra_scale_factor", config.muon_extra_scale_factor, nonnegative=True),
        fp32_matmul_prec=config.muon_fp32_matmul_prec, tp_mode=config.muon_tp_mode,
        head_splits=model_head_splits(model_chunks) if split_qkv else {},
        pg_collection=pg_collection)


def _ns_steps(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"muon_num_ns_steps must be an int >= 1, got {value!r}")
    return value


def _init_state(optimizer, config=None) -> None:
    """Momentum buffers for every parameter (Megatron's distributed checkpoint needs the
    state's structure before the first step)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if len(optimizer.state[p]) == 0:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


# --------------------------------------------------------------------------- optimizer
class MegatronMuonSplit(MuonSplit):
    """MuonSplit over Megatron's Muon param groups: per-parameter head splits, Megatron's
    scale modes and tensor-parallel modes.

    Megatron's groups are kept as they are (its scheduler sets ``lr`` / ``weight_decay`` on
    them, and its ``load_state_dict`` pairs saved and current groups by their ``max_lr``,
    ``wd_mult``, ... keys, so a group split in two would collide); the HeadSplit is looked up
    per parameter instead of per group. Built by :func:`register`'s entry from
    ``OptimizerConfig``.
    """

    def __init__(self, params, *, lr: float, weight_decay: float, momentum: float,
                 nesterov: bool, num_ns_steps: int, coefficients, scale_mode: str,
                 extra_scale_factor: float, fp32_matmul_prec: str, tp_mode: str,
                 head_splits: Dict[int, HeadSplit], pg_collection=None):
        for name, value, choices in (("muon_scale_mode", scale_mode, SCALE_MODES),
                                     ("muon_tp_mode", tp_mode, TP_MODES),
                                     ("muon_fp32_matmul_prec", fp32_matmul_prec,
                                      tuple(OPERAND_DTYPES))):
            if value not in choices:
                raise ValueError(f"{name}={value!r}: expected one of {list(choices)}")
        groups = [dict(g, use_muon=True, ns_coefficients=coefficients) if isinstance(g, dict)
                  else {"params": g, "use_muon": True, "ns_coefficients": coefficients}
                  for g in params]
        for group in groups:
            group["params"] = list(group["params"])
            for p in group["params"]:
                split = head_splits.get(id(p))
                if split is not None:
                    split.for_rows(p.shape[0])          # raises unless whole heads
        super().__init__(groups, lr, momentum=momentum, nesterov=nesterov,
                         ns_steps=num_ns_steps, rms_scale=extra_scale_factor,
                         weight_decay=weight_decay)
        self.head_splits = dict(head_splits)
        self.ns_config = NSConfig(operand_dtype=OPERAND_DTYPES[fp32_matmul_prec])
        self.scale_mode, self.tp_mode = scale_mode, tp_mode
        self.extra_scale_factor = extra_scale_factor
        self.pg_collection = pg_collection

    def _head_split(self, group: dict, p: torch.Tensor) -> Optional[HeadSplit]:
        return self.head_splits.get(id(p))

    # ---- tensor parallelism
    def _tp_group(self, p):
        if self.pg_collection is None:
            return None
        if getattr(p, "expert_tp", False):
            return getattr(self.pg_collection, "expt_tp", None)
        return getattr(self.pg_collection, "tp", None)

    def _gathered_dim(self, group: dict, p: torch.Tensor) -> Optional[int]:
        """The dim along which NS must see the TP shards of ``p`` gathered, or None (head
        splits are shard-local; ``blockwise`` treats every shard as a matrix)."""
        if self.tp_mode == "blockwise" or self._head_split(group, p) is not None:
            return None
        dim = getattr(p, "partition_dim", None)
        tp = self._tp_group(p)
        if dim not in (0, 1) or tp is None or torch.distributed.get_world_size(tp) == 1:
            return None
        return dim

    def _update_scale(self, group: dict, p: torch.Tensor, block_shape) -> float:
        shape = list(block_shape)
        dim = self._gathered_dim(group, p)
        if dim is not None:                 # the whole matrix's scale, as Megatron's TP modes
            shape[dim] *= torch.distributed.get_world_size(self._tp_group(p))
        return self.extra_scale_factor * muon_scale(shape[0], shape[1], self.scale_mode)

    def _orthogonalize(self, entries, group: dict, schedule) -> List[torch.Tensor]:
        sharded = {i: dim for i, (p, _) in enumerate(entries)
                   if (dim := self._gathered_dim(group, p)) is not None}
        if not sharded:
            return super()._orthogonalize(entries, group, schedule)
        if self.tp_mode == "duplicated":
            work = [(p, _all_gather(u, sharded[i], self._tp_group(p))) if i in sharded
                    else (p, u) for i, (p, u) in enumerate(entries)]
            per_entry = self._per_entry(super()._orthogonalize(work, group, schedule), work,
                                        group)
            for i, dim in sharded.items():
                per_entry[i] = [_own_part(per_entry[i][0], dim, self._tp_group(entries[i][0]))]
        else:
            per_entry = self._owner_compute(entries, group, schedule, sharded)
        return [result for results in per_entry for result in results]

    def _per_entry(self, results, work, group) -> List[List[torch.Tensor]]:
        """The flat block results of ``work`` cut into one list per entry (a head-split
        parameter has one result per block part, a whole matrix one)."""
        out, position = [], 0
        for p, _ in work:
            split = self._head_split(group, p)
            count = 1 if split is None else len(split.block_rows)
            out.append(results[position:position + count])
            position += count
        return out

    def _owner_compute(self, entries, group, schedule, sharded) -> List[List[torch.Tensor]]:
        """``distributed``: the k-th sharded matrix is gathered on rank k % tp of its TP
        group, orthogonalized there in the same batched call as the local matrices, and its
        rows scattered back: each matrix runs NS once, not on every TP rank."""
        owned = {}
        for k, (i, dim) in enumerate(sharded.items()):
            p, update = entries[i]
            tp = self._tp_group(p)
            world = torch.distributed.get_world_size(tp)
            mine = torch.distributed.get_rank(tp) == k % world
            pieces = [torch.empty_like(update) for _ in range(world)] if mine else None
            torch.distributed.gather(update.contiguous(), pieces, group=tp,
                                     dst=torch.distributed.get_global_rank(tp, k % world))
            if mine:
                owned[i] = torch.cat(pieces, dim=dim)
        computed = [i for i in range(len(entries)) if i not in sharded or i in owned]
        work = [(entries[i][0], owned.get(i, entries[i][1])) for i in computed]
        results = super()._orthogonalize(work, group, schedule) if work else []
        per_entry: List[List[torch.Tensor]] = [[] for _ in entries]
        for i, block_results in zip(computed, self._per_entry(results, work, group)):
            per_entry[i] = block_results
        for k, (i, dim) in enumerate(sharded.items()):
            p, update = entries[i]
            tp = self._tp_group(p)
            owner = k % torch.distributed.get_world_size(tp)
            part = torch.empty(update.shape, dtype=torch.float32, device=update.device)
            chunks = None
            if i in owned:
                chunks = [c.float().contiguous() for c in
                          per_entry[i][0][0].split(update.shape[dim], dim=dim)]
            torch.distributed.scatter(part, chunks, group=tp,
                                      src=torch.distributed.get_global_rank(tp, owner))
            per_entry[i] = [part[None]]
        return per_entry


def _all_gather(update: torch.Tensor, dim: int, tp) -> torch.Tensor:
    pieces = [torch.empty_like(update) for _ in range(torch.distributed.get_world_size(tp))]
    torch.distributed.all_gather(pieces, update.contiguous(), group=tp)
    return torch.cat(pieces, dim=dim)


def _own_part(result: torch.Tensor, dim: int, tp) -> torch.Tensor:
    """This TP rank's rows (dim 0) or columns (dim 1) of a [1, rows, cols] NS result."""
    size = result.shape[dim + 1] // torch.distributed.get_world_size(tp)
    return result.narrow(dim + 1, torch.distributed.get_rank(tp) * size, size)


# --------------------------------------------------------------------------- registry
def register(name: str = OPTIMIZER_NAME):
    """Add MuonSplit to Megatron's emerging-optimizer registry under ``name`` (idempotent).

    Afterwards ``get_megatron_optimizer(OptimizerConfig(optimizer=name, ...), model_chunks)``
    builds it, with Megatron's Muon routing (2-D non-embedding, non-output parameters here,
    the rest to Adam) and wrappers. Returns the registry entry. Raises ImportError naming
    what to install without megatron-core, ValueError if ``name`` is taken by another
    optimizer.
    """
    if not isinstance(name, str) or not name or name in ("adam", "sgd") \
            or name.startswith("dist_"):
        raise ValueError(f"name={name!r}: expected a non-empty str other than 'adam' / 'sgd' "
                         "and not starting with 'dist_' (Megatron's legacy prefix)")
    emerging = _emerging_module()
    registry = emerging._EMERGING_OPTIMIZERS
    existing = registry.get(name)
    if existing is not None:
        if existing.optimizer_cls is MegatronMuonSplit:
            return existing
        raise ValueError(f"Megatron's emerging optimizer {name!r} is already "
                         f"{existing.optimizer_cls.__name__}: register(name=...) another name")
    muon = registry.get("muon")
    # The "muon" entry's routing predicate (non-2-D or embedding/output -> Adam); rebuilt
    # from Megatron's own helper where this Megatron has no "muon" entry.
    overrides = (dict(muon.default_param_overrides) if muon is not None else
                 emerging._default_param_overrides_factory())
    entry = emerging.EmergingOptimizerEntry(optimizer_cls=MegatronMuonSplit,
                                            init_state_fn=_init_state,
                                            config_to_kwargs=_config_to_kwargs,
                                            default_param_overrides=overrides)
    registry[name] = entry
    return entry
