"""glm_kernels.testing: the comparison helpers fail as assertions, with a useful message."""
import os
import subprocess
import sys

import pytest
import torch

from glm_kernels.testing import assert_bits_equal
from tests.conftest import KERNEL_BACKEND


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


def test_each_value_once_keeps_every_value_on_the_kernels_first():
    """The version stages' ``--each-value-once`` (Makefile ``COVER``): of a test's 12 cases
    (2 backends x 3 vocabularies / dtypes x 2), the kernels run every value and the torch
    backend once; a nonsense option is refused, so the stages cannot run it silently off."""
    target = "tests/loss/test_dual_clip.py::test_from_logits_every_plan"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def collect(*options):
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                              "-p", "no:cacheprovider", "-p", "no:xdist", *options, target],
                             cwd=root, capture_output=True, text=True, timeout=300)
        return out, [line.split("[", 1)[1].rstrip("]") for line in out.stdout.splitlines()
                     if line.startswith(target + "[")]

    _, every = collect()
    _, kept = collect("--each-value-once")
    kernels = KERNEL_BACKEND
    assert len(every) == 12
    assert sorted(kept) == sorted(["torch-False-90-dtype0", f"{kernels}-False-90-dtype0",
                                   f"{kernels}-False-300-dtype1", f"{kernels}-False-517-dtype2",
                                   f"{kernels}-True-90-dtype0"]), kept
    refused, _ = collect("--each-value-twice")
    assert refused.returncode != 0
