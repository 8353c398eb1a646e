"""Against slime's own code: set SLIME_SRC to a slime checkout (THUDM/slime 624b824 or later)
to run the two checks in examples/slime/: check_delta_conformance.py (slime's real
UpdateWeightFromDiskDelta vs glm_kernels' install(), version directories compared) and
check_loss_conformance.py (slime's real loss_function / policy_loss_function with its own
IcePop TIS vs glm_kernels' TIS hook and custom loss, loss and logits gradient compared, at
CP = 1 and per rank at CP = 2 and 3, zigzag and --allgather-cp, in gloo processes; and every
loss option of slime 624b824 against slime_policy.policy_loss_function, loss, gradient and
every metric, at CP = 1). Skipped
when SLIME_SRC is not set (slime is not a dependency and cannot be fetched in CI)."""
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
    out = run_check("check_delta_conformance.py", "--steps", "2", "--device-bytes", device_bytes)
    assert out.count("identical") == 4


@pytest.mark.skipif(not SLIME_SRC, reason="set SLIME_SRC to a slime checkout")
def test_loss_matches_slime_own_icepop():
    # CP 2 and 3 spawn one process per rank, each compiling slime's torch.compile'd loss
    # (the check runs without Inductor's caches): minutes on a loaded 2-core machine.
    out = run_check("check_loss_conformance.py", "--seeds", "1", "--skip-options", timeout=900)
    lines = out.splitlines()
    # 2 temperatures x 2 reductions x 1 seed + the prompt-heavy sample, at CP = 1 and in every
    # CP layout; the two OPD advantage checks at CP = 1.
    layouts = ["T="] + [f"CP={cp} {mode} T=" for cp in (2, 3)
                        for mode in ("zigzag", "allgather-cp")]
    for layout in layouts:
        assert sum(line.startswith(layout) for line in lines) == 5, (layout, out[-3000:])
    assert sum(line.startswith("OPD advantage") for line in lines) == 2
    assert sum(line.startswith("top-p ") for line in lines) == 2     # CP = 1 only
    assert out.count("MISMATCH") == 0 and out.count("ERROR") == 0


@pytest.mark.skipif(not SLIME_SRC, reason="set SLIME_SRC to a slime checkout")
def test_every_slime_loss_option_matches_slime_policy_loss():
    sys.path.insert(0, os.path.join(ROOT, "examples", "slime"))
    from _policy_options import OPTIONS
    out = run_check("check_loss_conformance.py", "--seeds", "1", "--cp-sizes", timeout=900)
    lines = [line for line in out.splitlines() if line.startswith("option ")]
    assert len(lines) == 2 * len(OPTIONS), out[-3000:]     # T=1 per-sample, T=0.7 per-token
    assert all(" C loss " in line and " C grad " in line for line in lines)
    assert sum(" B loss " in line for line in lines) == 2 * sum(
        flags.get("custom_tis_function_path") == "slime_mis.compute_mis_weights_with_cp"
        for _, flags in OPTIONS)
    assert out.count("MISMATCH") == 0 and out.count("ERROR") == 0


def run_check(script, *flags, timeout=300):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "slime", script), "--slime-src",
         SLIME_SRC, *flags], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "conformance: PASS" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout
