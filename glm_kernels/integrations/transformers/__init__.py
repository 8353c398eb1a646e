"""glm_kernels inside transformers' MoE models: GLM-5 (``glm_moe_dsa``), GLM-4.5
(``glm4_moe``), DeepSeek-V3 / V4 and Qwen3-MoE.

* ``apply_glm_kernels(model)`` / ``apply_glm_kernels_to_<model_type>()``: routers through
  ``glm_kernels.moe_route``, the DSA indexer's top-k through ``glm_kernels.topk`` (no
  ``torch.topk`` in a patched forward; ties to the lower expert / token index).
* ``record_routing(model)`` / ``replay_routing(model, packets)``: rollout routing replay (R3).
* ``token_logprobs(model, input_ids)``: log-probs through ``fused_linear_logprobs``.
* ``glm_kernels.optim.muon_param_groups(model)`` reads these models' head layouts.

Needs transformers >= 5.2 (imported lazily, by the functions that patch); the 5.2-5.10
layout and the newer one (routing in the router's forward, indexers taking ``cache``) are
both patched (``installed_patches(model_type)`` says which methods). See
docs/transformers.md.
"""
from ._patch import (SUPPORTED_MODEL_TYPES, apply_glm_kernels, apply_glm_kernels_to_deepseek_v3,
                     apply_glm_kernels_to_deepseek_v4, apply_glm_kernels_to_glm4_moe,
                     apply_glm_kernels_to_glm_moe_dsa, apply_glm_kernels_to_qwen3_moe,
                     installed_patches, routing_modules)
from .logprobs import token_logprobs
from .r3 import RoutingRecord, RoutingReplay, record_routing, replay_routing

__all__ = ["SUPPORTED_MODEL_TYPES", "apply_glm_kernels", "apply_glm_kernels_to_glm_moe_dsa",
           "apply_glm_kernels_to_glm4_moe", "apply_glm_kernels_to_deepseek_v3",
           "apply_glm_kernels_to_deepseek_v4", "apply_glm_kernels_to_qwen3_moe",
           "installed_patches", "routing_modules", "token_logprobs", "record_routing",
           "replay_routing", "RoutingRecord", "RoutingReplay"]
