"""Muon Split: batched per-head Newton-Schulz kernels and the MuonSplit optimizer.

    newton_schulz(G, steps=5, *, coefficients="jordan", method="standard", eps=1e-7)
    HeadSplit(num_heads, block_rows); muon_split_orthogonalize(G, split, ...)
    MuonSplit / muon_param_groups (also in glm_kernels.optim)

Modules: ``ns`` (newton_schulz and the ragged-batch engine), ``split`` (HeadSplit, presets),
``optimizer`` (MuonSplit, routing), ``coefficients`` (schedules, bands), ``_kernels``
(Triton), ``_reference`` (the readable torch definition and CPU path).
"""
from .coefficients import JORDAN, POLAR_EXPRESS, resolve_coefficients, singular_value_band
from .ns import NSConfig, newton_schulz
from .optimizer import MuonSplit, muon_param_groups
from .split import (DEEPSEEK_V3_HEAD_SPLITS, GLM5_HEAD_SPLITS, HeadSplit,
                    head_splits_from_config, mla_head_splits, muon_split_orthogonalize)

__all__ = ["newton_schulz", "NSConfig", "HeadSplit", "muon_split_orthogonalize",
           "MuonSplit", "muon_param_groups", "mla_head_splits", "head_splits_from_config",
           "GLM5_HEAD_SPLITS", "DEEPSEEK_V3_HEAD_SPLITS", "JORDAN", "POLAR_EXPRESS",
           "resolve_coefficients", "singular_value_band"]
