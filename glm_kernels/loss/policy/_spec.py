"""The policy-loss family's compile-time spec, its named presets, and their argument checks.

A :class:`PolicyLossSpec` names how the importance ratio is formed (``ratio``) and what each
token's loss is (``objective``); the Triton kernel takes both as ``tl.constexpr`` switches, so
each preset compiles to its own straight-line code (the way OpenAI's triton_kernels carry a
frozen config per variant). The hyper-parameters (clip bands, temperatures, ...) stay runtime
floats: changing a value never recompiles.
"""
from dataclasses import dataclass
from typing import Dict, Optional

from ... import _checks

RATIOS = ("token", "sequence_stopgrad", "sequence", "geo_mean", "sequence_sum")
OBJECTIVES = ("ppo", "cispo", "sapo", "reinforce", "dppo_tv", "dppo_kl", "dro", "clip_cov",
              "kl_cov", "vespo")
REDUCTIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
              "seq_mean_token_sum_norm", "sum", "none", "row_mean")
GATES = (None, "coupled", "decoupled")

# Each objective's runtime parameters and their defaults (verl ActorConfig / TRL GRPOConfig
# defaults). None = derived from eps_low / eps_high, or required (dro_beta).
OBJECTIVE_PARAMS: Dict[str, Dict[str, Optional[float]]] = {
    "ppo": {"delta": None},
    "cispo": {"cispo_min": None, "cispo_max": None},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "reinforce": {},
    "dppo_tv": {"ratio_cap": 3.0},
    "dppo_kl": {"ratio_cap": 3.0},
    "dro": {"dro_beta": None},
    "clip_cov": {},
    "kl_cov": {"ppo_kl_coef": 0.1},
    "vespo": {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},
}


@dataclass(frozen=True)
class PolicyLossSpec:
    """One member of the fused policy-loss family.

    ratio:
        ``"token"``: r_t = exp(clamp(lp_t - old_t)).
        ``"sequence_stopgrad"`` (verl GSPO): log s_t = lp_t - sg(lp_t) + sg(mean_m(lp - old)),
        capped above at ``seq_log_ratio_max``; the gradient of token t is its own.
        ``"sequence"`` (TRL ``importance_sampling_level="sequence"``): s_b = exp(mean_m(lp - old))
        shared by the row, the gradient flows through the mean to every token of the row.
        ``"geo_mean"`` (verl GMPO): one loss per sequence from the mean clipped log-ratio.
        ``"sequence_sum"`` (TRL VESPO): w_b = exp(clamp(sum_m clamp(lp - old))), detached.
    objective: the per-token loss (docs/policy_loss.md has each formula).
    log_ratio_clamp: |lp - old| clamp before exp (None: no clamp, as verl's clip_cov, kl_cov,
        dro and geo_mean).
    seq_log_ratio_max: upper cap of the sequence log-ratio (GSPO: 10).
    default_reduction: what ``reduction=None`` means for this spec.
    """
    ratio: str = "token"
    objective: str = "ppo"
    log_ratio_clamp: Optional[float] = 20.0
    seq_log_ratio_max: Optional[float] = None
    default_reduction: str = "token_mean"

    def __post_init__(self):
        _checks.check_choice("PolicyLossSpec.ratio", self.ratio, RATIOS)
        _checks.check_choice("PolicyLossSpec.objective", self.objective, OBJECTIVES)
        _checks.check_choice("PolicyLossSpec.default_reduction", self.default_reduction,
                               REDUCTIONS)
        if self.log_ratio_clamp is not None:
            _checks.check_finite_number("PolicyLossSpec.log_ratio_clamp",
                                          self.log_ratio_clamp, positive=True)
        if self.seq_log_ratio_max is not None:
            _checks.check_finite_number("PolicyLossSpec.seq_log_ratio_max",
                                          self.seq_log_ratio_max)
        if self.ratio == "geo_mean" and self.objective != "ppo":
            raise ValueError("PolicyLossSpec: ratio='geo_mean' (GMPO) goes with objective='ppo', "
                             f"got objective={self.objective!r}")
        if (self.ratio == "sequence_sum") != (self.objective == "vespo"):
            raise ValueError("PolicyLossSpec: ratio='sequence_sum' and objective='vespo' go "
                             f"together, got ratio={self.ratio!r}, objective={self.objective!r}")
        token_only = ("dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov", "reinforce")
        if self.objective in token_only and self.ratio != "token":
            raise ValueError(f"PolicyLossSpec: objective={self.objective!r} takes ratio='token', "
                             f"got ratio={self.ratio!r}")

    @property
    def per_sequence_ratio(self) -> bool:
        """Whether a token's ratio needs its sequence's reduced log-ratio (second phase)."""
        return self.ratio != "token"


_TOKEN = PolicyLossSpec
POLICY_VARIANTS: Dict[str, PolicyLossSpec] = {
    # verl 0.9.1 POLICY_LOSS_REGISTRY
    "vanilla": _TOKEN("token", "ppo"),
    "gspo": _TOKEN("sequence_stopgrad", "ppo", log_ratio_clamp=None, seq_log_ratio_max=10.0),
    "gpg": _TOKEN("token", "reinforce", log_ratio_clamp=None),
    "clip_cov": _TOKEN("token", "clip_cov", log_ratio_clamp=None),
    "kl_cov": _TOKEN("token", "kl_cov", log_ratio_clamp=None),
    "geo_mean": _TOKEN("geo_mean", "ppo", log_ratio_clamp=None, default_reduction="row_mean"),
    "cispo": _TOKEN("token", "cispo"),
    "sapo": _TOKEN("token", "sapo", default_reduction="seq_mean_token_mean"),
    "dro": _TOKEN("token", "dro", log_ratio_clamp=None),
    "dppo_kl": _TOKEN("token", "dppo_kl"),
    "dppo_tv": _TOKEN("token", "dppo_tv"),
    "bypass_mode": _TOKEN("token", "ppo"),
    "bypass_mode_reinforce": _TOKEN("token", "reinforce", log_ratio_clamp=None,
                                    default_reduction="seq_mean_token_sum"),
    # TRL 1.16 loss types with their own objective or ratio
    "trl_cispo": _TOKEN("token", "cispo", log_ratio_clamp=None),
    "trl_sapo": _TOKEN("token", "sapo", log_ratio_clamp=None,
                       default_reduction="seq_mean_token_mean"),
    "luspo": _TOKEN("sequence", "ppo", log_ratio_clamp=None,
                    default_reduction="seq_mean_token_sum"),
    "grpo_sequence": _TOKEN("sequence", "ppo", log_ratio_clamp=None,
                            default_reduction="seq_mean_token_mean"),
    "vespo": _TOKEN("sequence_sum", "vespo", log_ratio_clamp=20.0),
}


def resolve_variant(variant) -> PolicyLossSpec:
    """A preset name or a PolicyLossSpec -> the spec (TypeError/ValueError naming ``variant``)."""
    if isinstance(variant, PolicyLossSpec):
        return variant
    if isinstance(variant, str):
        if variant not in POLICY_VARIANTS:
            raise ValueError(f"variant={variant!r}: expected a PolicyLossSpec or one of "
                             f"{sorted(POLICY_VARIANTS)}")
        return POLICY_VARIANTS[variant]
    raise TypeError(f"variant must be a preset name (str) or a PolicyLossSpec, got "
                    f"{type(variant).__name__}")


def resolve_params(spec: PolicyLossSpec, params: dict, eps_low: float, eps_high: float
                   ) -> Dict[str, float]:
    """The objective's parameters as floats: unknown names refused, defaults filled in."""
    allowed = OBJECTIVE_PARAMS[spec.objective]
    for name in params:
        if name not in allowed:
            raise TypeError(f"policy_loss: unexpected keyword argument {name!r} for objective "
                            f"{spec.objective!r} (it takes {sorted(allowed) or 'none'})")
    out = {}
    for name, default in allowed.items():
        value = params.get(name, default)
        if value is not None:
            value = _checks.check_finite_number(name, value)
        out[name] = value
    obj = spec.objective
    if obj == "cispo":
        out["cispo_min"] = 1.0 - eps_low if out["cispo_min"] is None else out["cispo_min"]
        out["cispo_max"] = 1.0 + eps_high if out["cispo_max"] is None else out["cispo_max"]
        if not out["cispo_min"] <= out["cispo_max"]:
            raise ValueError(f"cispo_min must be <= cispo_max, got {out['cispo_min']} > "
                             f"{out['cispo_max']}")
    elif obj == "sapo":
        for name in ("tau_pos", "tau_neg"):
            if out[name] <= 0:
                raise ValueError(f"{name} must be > 0 (SAPO's gate divides by it), got "
                                 f"{out[name]}")
    elif obj == "dro":
        if out["dro_beta"] is None or out["dro_beta"] <= 0:
            raise ValueError(f"dro_beta must be a number > 0 for objective 'dro', got "
                             f"{params.get('dro_beta')!r}")
    elif obj in ("dppo_tv", "dppo_kl"):
        if out["ratio_cap"] <= 0:
            raise ValueError(f"ratio_cap must be > 0, got {out['ratio_cap']}")
    elif obj == "ppo" and out["delta"] is not None and out["delta"] <= 0:
        raise ValueError(f"delta must be > 0 (TRL caps the ratio at delta), got {out['delta']}")
    return out
