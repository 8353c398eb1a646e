"""Deterministic top-k (MoE routing, DSA indexer), DeepSeek-V3 ``noaux_tc`` routing, and
rollout routing replay (``moe_route(replay_ids=...)``, ``routing_codec``'s wire packets).

``glm_kernels.topk`` (once re-exported by the top-level package) is the *function*; this
subpackage stays importable as ``from glm_kernels.topk import topk, moe_route, _reference``.
"""
from .moe_route import (MoeReplay, MoeRoute, MoeRouteConfig, make_moe_route_config, moe_route,
                        routing_mismatch)
from .routing_codec import (RoutingBatch, RoutingHeader, decode_routing, decode_routing_batch,
                            encode_routing, encode_routing_batch, routing_header)
from .topk import TopK, TopkConfig, make_topk_config, topk

__all__ = ["topk", "moe_route", "TopK", "TopkConfig", "make_topk_config", "MoeRoute",
           "MoeRouteConfig", "make_moe_route_config", "MoeReplay", "routing_mismatch",
           "encode_routing", "decode_routing", "encode_routing_batch", "decode_routing_batch",
           "routing_header", "RoutingHeader", "RoutingBatch"]
