"""Newton-Schulz coefficient schedules and the singular-value band each one promises.

One Newton-Schulz step applies the odd quintic p(x) = a x + b x^3 + c x^5 to every singular
value of X (X <- a X + (b A + c A^2) X with A = X X^T). After the Frobenius normalization every
singular value lies in [0, 1]; ``steps`` steps apply the composition p_T o ... o p_1.

Schedules
---------
``"jordan"``: (3.4445, -4.7750, 2.0315) every step (Keller Jordan's Muon, modded-nanogpt
``zeropower_via_newtonschulz5``). It does not converge to 1: its author describes the output as
U S' V^T with S' roughly uniform in (0.5, 1.5). The tight band, from the composition itself
(:func:`singular_value_band`), is [0.6818, 1.1344] once a value has entered it; after 5 steps
every value starting in [0.01, 1] is in [0.6818, 1.1344] (from [0.001, 1]: [0.4705, 1.2024]).

``"polar_express"``: the per-step minimax quintics of Amsel, Persson, Musco, Gower,
"The Polar Express: Optimal Matrix Sign Methods and Their Application to the Muon Algorithm"
(arXiv:2505.16932, 2025), Algorithm 1: designed for singular values in [l, u] = [1e-3, 1],
each polynomial evaluated at x / 1.01 (a / 1.01, b / 1.01^3, c / 1.01^5) for bf16 safety,
except the last, which later steps repeat. After 5 steps values from [0.001, 1] land in
[0.8462, 1.1236]; after 6 in [0.9944, 1.0012]; the schedule converges to 1.

A list of (a, b, c) triples is a schedule too: step t uses entry t, and steps past the end of
the list repeat its last entry (the same rule as polar_express).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

Coefficients = Union[str, Sequence[Sequence[float]]]

JORDAN: Tuple[Tuple[float, float, float], ...] = ((3.4445, -4.7750, 2.0315),)

# arXiv:2505.16932, Algorithm 1 (the values also used by modded-nanogpt and NVIDIA's
# emerging-optimizers): the raw minimax quintics for l = 1e-3, u = 1 ...
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# ... and the paper's safety factor: p(x / 1.01) for all but the last polynomial.
POLAR_EXPRESS: Tuple[Tuple[float, float, float], ...] = tuple(
    (a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)

SCHEDULES = {"jordan": JORDAN, "polar_express": POLAR_EXPRESS}


def resolve_coefficients(coefficients: Coefficients, steps: int) -> List[Tuple[float, float, float]]:
    """The (a, b, c) of each of ``steps`` steps, validated (ValueError/TypeError naming the arg)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in SCHEDULES:
            raise ValueError(f"coefficients={coefficients!r}: expected one of "
                             f"{sorted(SCHEDULES)} or a list of (a, b, c)")
        table = SCHEDULES[coefficients]
    else:
        try:
            table = [tuple(float(v) for v in entry) for entry in coefficients]
        except TypeError as exc:
            raise TypeError("coefficients must be a schedule name or a list of (a, b, c) "
                            f"triples, got {coefficients!r}") from exc
        if not table or any(len(entry) != 3 for entry in table):
            raise ValueError("coefficients must be a non-empty list of (a, b, c) triples, got "
                             f"{coefficients!r}")
        if any(v != v or v in (float("inf"), float("-inf")) for entry in table for v in entry):
            raise ValueError(f"coefficients must be finite, got {coefficients!r}")
    return [tuple(table[min(t, len(table) - 1)]) for t in range(steps)]


def singular_value_band(coefficients: Coefficients, steps: int, lower: float,
                        upper: float = 1.0, points: int = 200_001) -> Tuple[float, float]:
    """[min, max] of the composed scalar polynomial over input singular values in [lower, upper].

    Exact-arithmetic promise of a schedule (float64 on a dense log-spaced grid, endpoints
    included): a matrix whose normalized singular values lie in [lower, upper] comes out of
    ``steps`` steps with singular values in this band (plus rounding in finite precision).
    """
    import numpy as np
    if not 0 < lower <= upper:
        raise ValueError(f"need 0 < lower <= upper, got lower={lower}, upper={upper}")
    x = np.geomspace(lower, upper, points)
    for a, b, c in resolve_coefficients(coefficients, steps):
        x2 = x * x
        x = x * (a + x2 * (b + c * x2))
    return float(x.min()), float(x.max())
