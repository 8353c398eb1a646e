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


def _hang_first_time(rank, world, out_dir):
    """A rank body that hangs in the first run (before reporting) and reports in the retry."""
    import os
    import time
    if not out_dir.rstrip("/").endswith("retry"):
        open(os.path.join(out_dir, f"hung{rank}"), "w").close()
        time.sleep(120)
    first_run = os.path.dirname(out_dir.rstrip("/"))
    return {"rank": rank, "hung_before": os.path.exists(os.path.join(first_run, f"hung{rank}"))}


def test_gloo_ranks_retry_once_after_a_hang(tmp_path, monkeypatch):
    import pytest

    from tests import _gloo
    monkeypatch.setattr(_gloo, "SPAWN_TIMEOUT_S", 20)
    with pytest.warns(UserWarning, match="timed out after 20 s"):
        verdicts = _gloo.run_ranks(_hang_first_time, 2, tmp_path / "run", "hang test")
    assert verdicts == [{"rank": 0, "hung_before": True}, {"rank": 1, "hung_before": True}]


@pytest.mark.xdist_group("harness-check")
def test_xdist_groups_reach_the_scheduler(request):
    """make test relies on ``--dist loadgroup`` keeping each xdist_group on one worker (one
    local Ray instance at a time, module fixtures built once): pytest-xdist does it by renaming
    the node id, which pytest 9.2 ignores (the marks then do nothing, silently)."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not under pytest-xdist --dist loadgroup")
    assert request.node.nodeid.endswith("@harness-check"), request.node.nodeid
