"""Memory bounds for hostile-input tests: run a snippet in a fresh interpreter and report how
far its peak resident memory rose above the resident memory it started from (Linux: the
high-water mark ``VmHWM`` is reset through ``/proc/self/clear_refs`` after the setup, so the
setup's own peaks do not hide the snippet's)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def peak_rss_growth(setup: str, code: str, *, timeout: float = 300) -> tuple:
    """(bytes the peak RSS grew while ``code`` ran, the snippet's stdout). ``setup`` runs
    first (imports, inputs); both see the repository root first on ``sys.path``."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("peak-memory checks read Linux's /proc/self/status")
    script = "\n".join([
        "import sys",
        f"sys.path.insert(0, {str(REPO)!r})",
        "from tests._bounded import _status_kib, _reset_peak",
        textwrap.dedent(setup),
        "_before = _status_kib('VmRSS')",
        "_reset_peak()",
        textwrap.dedent(code),
        "print('PEAK_GROWTH', (_status_kib('VmHWM') - _before) * 1024)",
    ])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO), env=env)
    assert done.returncode == 0, f"snippet failed:\n{done.stdout}\n{done.stderr}"
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PEAK_GROWTH ")]
    assert lines, done.stdout
    return int(lines[-1].split()[1]), done.stdout


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """VmHWM := VmRSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
