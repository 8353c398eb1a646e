"""Test-side names for the comparison helpers (kept in glm_kernels.testing)."""
from glm_kernels.testing import TOLERANCES, assert_bits_equal, assert_close, rel_error  # noqa: F401
