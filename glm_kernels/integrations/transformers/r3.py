"""Rollout routing replay (R3) on transformers' MoE models patched by ``apply_glm_kernels``.

    with record_routing(model) as rec:            # rollout: generate (KV cache) or forward
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    packets = rec.packets()                       # one encode_routing packet per sequence

    with replay_routing(model, packets) as rep:   # training: the same rows (same padding)
        logprobs = token_logprobs(model, out)
        loss = ...; loss.backward()
    rep.mismatch_counts()                         # per MoE layer: tokens whose own choice differs

A packet holds every MoE layer's expert ids of every token the model ran for that row, in the
row's order (prompt with its padding, then each generated token fed back); ``generate`` never
runs its last sampled token, so a packet of a generated row is one token shorter than the
row. In replay, a token with a recorded routing uses exactly the recorded experts (weights
recomputed from the router logits, with gradients); a token past the packet's end (that last
token) routes by its own choice. The mismatch count of a layer is the number of recorded
tokens whose own choice is a different expert set.

Each forward inside a context must see whole rows from position 0 of the packet (a training
forward), one forward per backward under gradient checkpointing (the recomputed forward
replays the latest forward's rows and counts its mismatches again).
"""
import contextlib
from typing import Dict, List, Sequence

import torch

from ...topk import (decode_routing_batch, encode_routing, moe_route, routing_header,
                     routing_mismatch)
from . import _patch
from ._routers import R3_ATTR


def _n_experts(module) -> int:
    for name in ("n_routed_experts", "num_experts"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"cannot read the expert count of {type(module).__name__}")


def _patched_routing_modules(model) -> List[torch.nn.Module]:
    modules = _patch.routing_modules(model)
    method = {p.cls_name: p.method
              for p in _patch.installed_patches(_patch.model_type_of(model))}
    unpatched = [m for m in modules if not _patch.is_patched(m, method[type(m).__name__])]
    if not modules or unpatched:
        raise ValueError("R3 needs the model's routers patched: call "
                         "glm_kernels.integrations.transformers.apply_glm_kernels(model) (or "
                         "apply_glm_kernels_to_<model_type>() before loading) first")
    if any(getattr(m, R3_ATTR, None) is not None for m in modules):
        raise RuntimeError("a record_routing / replay_routing context is already active on "
                           "this model")
    return modules


class _Session:
    replaying = False

    def __init__(self, model, modules):
        self.modules = modules
        self.layer = {id(m): i for i, m in enumerate(modules)}
        self.layout = None
        self.body = getattr(model, getattr(model, "base_model_prefix", ""), None) or model

    def _on_forward(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else \
                kwargs.get("inputs_embeds")
        self.layout = tuple(x.shape[:2])

    def _rows(self, module, n_tokens: int):
        """(layer index, batch rows, tokens per row) of this router call."""
        if self.layout is None or self.layout[0] * self.layout[1] != n_tokens:
            raise RuntimeError(f"R3: a router saw {n_tokens} tokens, the model's forward "
                               f"{self.layout}: route inside the model's forward only")
        return (self.layer[id(module)],) + self.layout

    @contextlib.contextmanager
    def installed(self):
        handle = self.body.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        for m in self.modules:
            setattr(m, R3_ATTR, self)
        try:
            yield self
        finally:
            handle.remove()
            for m in self.modules:
                setattr(m, R3_ATTR, None)


class RoutingRecord(_Session):
    """What ``record_routing`` yields: ``packets()`` after the recorded forwards."""

    def __init__(self, model, modules):
        super().__init__(model, modules)
        self.calls: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(modules))}

    def record(self, module, ids: torch.Tensor) -> None:
        layer, batch, seq = self._rows(module, ids.shape[0])
        self.calls[layer].append(ids.detach().view(batch, seq, -1))

    def ids(self) -> torch.Tensor:
        """int64 [n_layers, B, tokens, k]: every call's ids, concatenated along the tokens."""
        per_layer = [torch.cat(self.calls[i], dim=1) for i in range(len(self.modules))
                     if self.calls[i]]
        if len(per_layer) != len(self.modules):
            raise RuntimeError(f"R3: {len(per_layer)} of {len(self.modules)} MoE layers ran "
                               "inside record_routing")
        if len({tuple(t.shape) for t in per_layer}) != 1:
            raise RuntimeError("R3: the MoE layers recorded different token counts")
        return torch.stack(per_layer)

    def packets(self) -> List[torch.Tensor]:
        """One ``encode_routing`` packet (uint8 tensor) per row of the recorded batch."""
        ids = self.ids()
        n_experts = _n_experts(self.modules[0])
        return [encode_routing(ids[:, b], n_experts) for b in range(ids.shape[1])]


class RoutingReplay(_Session):
    """What ``replay_routing`` yields: ``mismatch_counts()`` per MoE layer."""
    replaying = True

    def __init__(self, model, modules, packets):
        super().__init__(model, modules)
        device = next(model.parameters()).device
        batch = decode_routing_batch(packets, device=device)
        n_layers, _, _, k = batch.ids.shape
        if n_layers != len(modules) or k != modules[0].top_k \
                or _n_experts(modules[0]) != _routing_header_experts(packets[0]):
            raise ValueError(f"packets hold {n_layers} layers x k={k} of "
                             f"{_routing_header_experts(packets[0])} experts; the model has "
                             f"{len(modules)} MoE layers x k={modules[0].top_k} of "
                             f"{_n_experts(modules[0])} experts")
        self.batch_ids, self.lengths = batch.ids, batch.lengths.to(device)
        self.mismatch = torch.zeros(len(modules), dtype=torch.int64, device=device)

    def replay(self, module, router_logits, k, kwargs, fixed_ids):
        layer, rows, seq = self._rows(module, router_logits.shape[0])
        if rows != self.batch_ids.shape[1]:
            raise RuntimeError(f"R3: the forward has {rows} rows, replay_routing got "
                               f"{self.batch_ids.shape[1]} packets")
        width = self.batch_ids.shape[2]
        recorded_ids = self.batch_ids[layer, :, :min(seq, width)]
        if seq > width:
            recorded_ids = torch.cat([recorded_ids, recorded_ids.new_zeros(
                rows, seq - width, k)], dim=1)
        positions = torch.arange(seq, device=self.lengths.device)
        recorded = (positions[None, :] < self.lengths[:, None]).reshape(-1)
        recorded_ids = recorded_ids.reshape(-1, k)
        if fixed_ids is not None:
            own = fixed_ids
        else:
            with torch.no_grad():
                own = moe_route(router_logits.detach(), k, **kwargs).ids
        use = torch.where(recorded[:, None], recorded_ids, own)
        if fixed_ids is None:
            out = moe_route(router_logits, k, replay_ids=use, return_mismatch=True, **kwargs)
            mismatch = out.mismatch
        else:
            out = moe_route(router_logits, k, replay_ids=use, **kwargs)
            mismatch = routing_mismatch(own, use)
        self.mismatch[layer] += (mismatch & recorded).sum()
        return out.weights, out.ids

    def mismatch_counts(self) -> List[int]:
        """Per MoE layer (model order): recorded tokens whose own choice is another set."""
        return self.mismatch.tolist()


def _routing_header_experts(packet) -> int:
    return routing_header(packet).n_experts


@contextlib.contextmanager
def record_routing(model: torch.nn.Module):
    """Record every MoE layer's routing of every forward inside (``generate`` included).

    Yields a ``RoutingRecord``: ``rec.packets()`` -> one packet per row (``encode_routing``
    format, every MoE layer, the row's tokens in order); ``rec.ids()`` -> int64
    [n_layers, B, tokens, k]. The model must be patched by ``apply_glm_kernels``.
    """
    with RoutingRecord(model, _patched_routing_modules(model)).installed() as rec:
        yield rec


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, packets: Sequence):
    """Route every forward inside by the recorded experts of ``packets`` (one per row).

    Yields a ``RoutingReplay``: ``rep.mismatch_counts()`` -> per MoE layer, how many recorded
    tokens' own choice differs from the recorded set. Weights are recomputed from the router
    logits (gradients flow to the router); tokens past a packet's end route by their own
    choice. Packets whose layer count, k or expert count differ from the model's raise
    ValueError.
    """
    with RoutingReplay(model, _patched_routing_modules(model), packets).installed() as rep:
        yield rep
