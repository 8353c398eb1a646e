"""Deterministic top-k (MoE routing, DSA indexer) and DeepSeek-V3 ``noaux_tc`` routing.

``glm_kernels.topk`` (once re-exported by the top-level package) is the *function*; this
subpackage stays importable as ``from glm_kernels.topk import topk, moe_route, _reference``.
"""
from .moe_route import (MoeReplay, MoeRoute, MoeRouteConfig, make_moe_route_config, moe_route,
                        routing_mismatch)
from .topk import TopK, TopkConfig, make_topk_config, topk

__all__ = ["topk", "moe_route", "TopK", "TopkConfig", "make_topk_config", "MoeRoute",
           "MoeRouteConfig", "make_moe_route_config", "MoeReplay", "routing_mismatch"]
