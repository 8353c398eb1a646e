"""Against slime's own code: set SLIME_SRC to a slime checkout (one that has
slime/utils/disk_delta.py) to run examples/slime/check_delta_conformance.py, which publishes the
same steps with slime's real UpdateWeightFromDiskDelta and with glm_kernels' install() and
compares the version directories. Skipped when SLIME_SRC is not set (slime is not a
dependency and cannot be fetched in CI)."""
import os
import subprocess
import sys

import pytest

SLIME_SRC = os.environ.get("SLIME_SRC")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(not SLIME_SRC, reason="set SLIME_SRC to a slime checkout")
@pytest.mark.parametrize("device_bytes", ["0", str(1 << 30)])
def test_files_match_slime_own_encoder(device_bytes):
    pytest.importorskip("zstandard")
    pytest.importorskip("safetensors")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "slime", "check_delta_conformance.py"),
         "--slime-src", SLIME_SRC, "--steps", "2", "--device-bytes", device_bytes],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "conformance: PASS" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("identical") == 4
