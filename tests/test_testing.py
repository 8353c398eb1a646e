"""glm_kernels.testing: the comparison helpers fail as assertions, with a useful message."""
import pytest
import torch

from glm_kernels.testing import assert_bits_equal


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5)])
def test_assert_bits_equal_reports_first_differing_byte(shape):
    out = torch.zeros(shape)
    ref = out.clone()
    ref.view(-1)[5] = -0.0                      # only the sign bit: byte 4 * 5 + 3
    with pytest.raises(AssertionError, match="1 bytes differ, first at byte 23"):
        assert_bits_equal(out, ref)
    assert_bits_equal(out, out.clone())
    assert_bits_equal(torch.empty(0, *shape[1:]), torch.empty(0, *shape[1:]))
