"""``apply_glm_kernels(model)`` (one loaded model) and ``apply_glm_kernels_to_<model_type>()``
(the transformers classes, before ``from_pretrained``), following Liger-Kernel's convention.

What is replaced, per ``model_type`` (class -> method):

    glm_moe_dsa  GlmMoeDsaMoE.route_tokens_to_experts   (routing)
                 GlmMoeDsaIndexer.forward                (indexer)
    glm4_moe     Glm4MoeMoE.route_tokens_to_experts      (routing)
    deepseek_v3  DeepseekV3MoE.route_tokens_to_experts   (routing)
    deepseek_v4  DeepseekV4TopKRouter.forward, DeepseekV4HashRouter.forward  (routing)
                 DeepseekV4Indexer.forward               (indexer)
    qwen3_moe    Qwen3MoeTopKRouter.forward              (routing)

That is transformers 5.2-5.10's layout. Newer releases (5.25) route in the router's forward
(GlmMoeDsaTopkRouter, Glm4MoeTopkRouter, DeepseekV3TopkRouter ``.forward(hidden_states)``) and
pass the indexers the model's Cache as ``cache``: ``NEWER`` holds those forms and
``installed_patches`` picks, per method, the one the installed release has.

Methods are replaced, modules are not: parameters, buffers, state-dict names, forward
signatures, hooks and ``isinstance`` checks stay as they were.
"""
import importlib
import inspect
import types
from typing import Dict, List, NamedTuple, Tuple

import torch

from ... import _checks
from . import _routers


class Patch(NamedTuple):
    """One replaced method: ``cls_name.method`` in the model type's modeling module."""
    kind: str            # "routing" or "indexer"
    cls_name: str
    method: str
    function: object


_NOAUX = _routers.noaux_route_tokens_to_experts
PATCHES: Dict[str, Tuple[Patch, ...]] = {
    "glm_moe_dsa": (Patch("routing", "GlmMoeDsaMoE", "route_tokens_to_experts", _NOAUX),
                    Patch("indexer", "GlmMoeDsaIndexer", "forward",
                          _routers.glm_moe_dsa_indexer_forward)),
    "glm4_moe": (Patch("routing", "Glm4MoeMoE", "route_tokens_to_experts", _NOAUX),),
    "deepseek_v3": (Patch("routing", "DeepseekV3MoE", "route_tokens_to_experts", _NOAUX),),
    "deepseek_v4": (Patch("routing", "DeepseekV4TopKRouter", "forward",
                          _routers.deepseek_v4_router_forward),
                    Patch("routing", "DeepseekV4HashRouter", "forward",
                          _routers.deepseek_v4_hash_router_forward),
                    Patch("indexer", "DeepseekV4Indexer", "forward",
                          _routers.deepseek_v4_indexer_forward)),
    "qwen3_moe": (Patch("routing", "Qwen3MoeTopKRouter", "forward",
                        _routers.qwen3_router_forward),),
}
# Where a transformers release after 5.10 moved or re-signed a replaced method, the patch for
# its layout: noaux_tc routing moved from the MoE block's route_tokens_to_experts(logits) into
# the router's forward(hidden_states); the DSA indexers take the model's Cache as ``cache``.
_NOAUX_ROUTER = _routers.noaux_router_forward
NEWER: Dict[Tuple[str, str], Patch] = {
    ("GlmMoeDsaMoE", "route_tokens_to_experts"):
        Patch("routing", "GlmMoeDsaTopkRouter", "forward", _NOAUX_ROUTER),
    ("Glm4MoeMoE", "route_tokens_to_experts"):
        Patch("routing", "Glm4MoeTopkRouter", "forward", _NOAUX_ROUTER),
    ("DeepseekV3MoE", "route_tokens_to_experts"):
        Patch("routing", "DeepseekV3TopkRouter", "forward", _NOAUX_ROUTER),
    ("GlmMoeDsaIndexer", "forward"):
        Patch("indexer", "GlmMoeDsaIndexer", "forward",
              _routers.glm_moe_dsa_indexer_forward_cache),
    ("DeepseekV4Indexer", "forward"):
        Patch("indexer", "DeepseekV4Indexer", "forward",
              _routers.deepseek_v4_indexer_forward_cache),
}
SUPPORTED_MODEL_TYPES = tuple(PATCHES)
_ALL_FUNCTIONS = ({p.function for patches in PATCHES.values() for p in patches}
                  | {p.function for p in NEWER.values()})


def _modeling_module(model_type: str):
    try:
        return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError as exc:
        raise ImportError(f"glm_kernels: transformers has no model type {model_type!r} here "
                          f"({exc}); glm_kernels' transformers integration needs "
                          "transformers >= 5.2 (pip install 'transformers>=5.2')") from exc


def _check_flags(routing, indexer) -> Tuple[bool, bool]:
    return _checks.check_bool("routing", routing), _checks.check_bool("indexer", indexer)


def _original(cls, method: str):
    """transformers' own ``cls.method`` (None where this release has no such method)."""
    return _routers.ORIGINALS.get((cls, method), getattr(cls, method, None))


def installed_patches(model_type: str) -> Tuple[Patch, ...]:
    """The patches of ``model_type`` for the installed transformers' layout: each entry of
    ``PATCHES`` (5.2-5.10), or its ``NEWER`` form where the method is gone or has the newer
    form's parameters."""
    modeling = _modeling_module(model_type)
    chosen = []
    for patch in PATCHES[model_type]:
        newer = NEWER.get((patch.cls_name, patch.method))
        cls = getattr(modeling, patch.cls_name, None)
        original = None if cls is None else _original(cls, patch.method)
        if newer is not None and (original is None or
                                  _parameters(original) == _parameters(newer.function)):
            patch = newer
        chosen.append(patch)
    return tuple(chosen)


def _selected(model_type: str, routing: bool, indexer: bool) -> List[Patch]:
    return [p for p in installed_patches(model_type)
            if (routing if p.kind == "routing" else indexer)]


def model_type_of(model: torch.nn.Module) -> str:
    """The ``config.model_type`` of a supported model; ValueError naming the supported ones."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got "
                        f"{type(model).__name__}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PATCHES:
        raise ValueError(f"glm_kernels supports the transformers model types "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}; got a {type(model).__name__} "
                         f"with model_type {model_type!r}")
    return model_type


def apply_glm_kernels(model: torch.nn.Module, *, routing: bool = True,
                      indexer: bool = True) -> torch.nn.Module:
    """Patch one loaded model in place: its MoE routers run ``glm_kernels.moe_route``, its DSA
    indexer's top-k runs ``glm_kernels.topk``. Other models in the process are unaffected.

    Parameters
    ----------
    model : a transformers model (``*ForCausalLM`` or its base model) whose
        ``config.model_type`` is one of ``SUPPORTED_MODEL_TYPES``; anything else raises
        ValueError naming them.
    routing : bool, default True
        Replace the MoE routers (noaux_tc sigmoid + groups + correction bias for GLM-5,
        GLM-4.5 and DeepSeek-V3; softmax top-k for Qwen3-MoE; DeepSeek-V4's scoring and its
        hash-routed layers).
    indexer : bool, default True
        Replace the top-k of the DSA indexer (GLM-5, DeepSeek-V4; no-op for other models).

    Returns
    -------
    The same ``model`` (patched), for chaining. Patching twice is harmless.
    """
    routing, indexer = _check_flags(routing, indexer)
    model_type = model_type_of(model)
    by_class = {p.cls_name: p for p in _selected(model_type, routing, indexer)}
    targets = [(m, by_class[type(m).__name__]) for m in model.modules()
               if type(m).__name__ in by_class]
    for module, patch in targets:          # every check before the first change
        _check_signature(type(module), patch)
    for module, patch in targets:
        setattr(module, patch.method, types.MethodType(patch.function, module))
    return model


def _parameters(function) -> List[str]:
    return list(inspect.signature(function).parameters)


def _check_signature(cls, patch: Patch) -> None:
    """Refuse a transformers release whose method takes other arguments than the replacement
    (e.g. 5.25's GLM-5 indexer takes a ``cache`` object): patching it would break the model's
    forward, so nothing is patched and the error names what to turn off."""
    original = _original(cls, patch.method)
    if original is patch.function:
        return
    if original is None or _parameters(original) != _parameters(patch.function):
        import transformers
        raise ValueError(
            f"apply_glm_kernels: {cls.__name__}.{patch.method}"
            f"{inspect.signature(original) if original else ' (absent)'} in transformers "
            f"{transformers.__version__} differs from the replacement's "
            f"{inspect.signature(patch.function)} (written for transformers 5.2-5.25); pass "
            f"{patch.kind}=False to leave it as transformers ships it")


def _apply_to_classes(model_type: str, routing, indexer) -> None:
    routing, indexer = _check_flags(routing, indexer)
    modeling = _modeling_module(model_type)
    selected = _selected(model_type, routing, indexer)
    for patch in selected:                 # every check before the first change
        if not hasattr(modeling, patch.cls_name):
            raise ValueError(f"apply_glm_kernels_to_{model_type}: transformers' "
                             f"{modeling.__name__} has no class {patch.cls_name}; pass "
                             f"{patch.kind}=False to leave that part as transformers ships it")
        _check_signature(getattr(modeling, patch.cls_name), patch)
    for patch in selected:
        cls = getattr(modeling, patch.cls_name)
        current = getattr(cls, patch.method)
        if current is not patch.function:
            _routers.ORIGINALS[(cls, patch.method)] = current
        setattr(cls, patch.method, patch.function)


def is_patched(module: torch.nn.Module, method: str) -> bool:
    """Whether ``module.<method>`` is one of glm_kernels' replacements (instance or class)."""
    bound = getattr(module, method, None)
    return getattr(bound, "__func__", None) in _ALL_FUNCTIONS


def routing_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules that route each MoE layer (model order), whether patched or not."""
    model_type = model_type_of(model)
    names = {p.cls_name: p.method for p in installed_patches(model_type)
             if p.kind == "routing"}
    return [m for m in model.modules() if type(m).__name__ in names]


def _class_patcher(model_type: str):
    def apply(*, routing: bool = True, indexer: bool = True) -> None:
        _apply_to_classes(model_type, routing, indexer)
    replaced = ", ".join(f"{p.cls_name}.{p.method}" for p in PATCHES[model_type])
    replaced += " (newer releases: the methods installed_patches names)"
    apply.__name__ = apply.__qualname__ = f"apply_glm_kernels_to_{model_type}"
    apply.__doc__ = (f"Patch transformers' ``{model_type}`` classes (every model built after "
                     f"this call, e.g. by ``from_pretrained``): {replaced}. ``routing`` and "
                     "``indexer`` (bool) select what is replaced, as in apply_glm_kernels.")
    return apply


apply_glm_kernels_to_glm_moe_dsa = _class_patcher("glm_moe_dsa")
apply_glm_kernels_to_glm4_moe = _class_patcher("glm4_moe")
apply_glm_kernels_to_deepseek_v3 = _class_patcher("deepseek_v3")
apply_glm_kernels_to_deepseek_v4 = _class_patcher("deepseek_v4")
apply_glm_kernels_to_qwen3_moe = _class_patcher("qwen3_moe")
