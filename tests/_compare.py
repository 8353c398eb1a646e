"""Test-side names for the comparison helpers (kept in glm_kernels.testing)."""
from glm_kernels.testing import TOLERANCES, assert_bits_equal, assert_close, rel_error  # noqa: F401


def assert_sum_close(out, ref, magnitude, *, tol, name="sum"):
    """A signed sum (a loss over random-sign advantages) can cancel far below its terms, and
    its rounding error scales with the terms, not with the result: judge |out - ref| against
    ``tol`` times ``magnitude``, the same sum taken over |terms|."""
    err = (out.detach().double() - ref.detach().double()).abs().max().item()
    bound = tol * magnitude.detach().double().abs().max().item()
    assert err <= bound, (f"{name}: |out - ref| = {err:.3e} > {tol:.1e} x the sum of |terms| "
                          f"({bound:.3e}); out {out.detach().tolist()} ref {ref.detach().tolist()}")
