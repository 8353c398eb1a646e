"""Memory bounds for hostile-input tests: run a snippet in a fresh interpreter and report how
far its peak resident memory grew while the snippet ran (``ru_maxrss`` is a high-water mark,
so the growth is measured from after the setup's imports and allocations)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def peak_rss_growth(setup: str, code: str, *, timeout: float = 300) -> tuple:
    """(bytes the peak RSS grew while ``code`` ran, the snippet's stdout). ``setup`` runs
    first (imports, inputs); both see the repository root first on ``sys.path``."""
    script = "\n".join([
        "import resource, sys",
        f"sys.path.insert(0, {str(REPO)!r})",
        textwrap.dedent(setup),
        "_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss",
        textwrap.dedent(code),
        "_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss",
        "print('PEAK_GROWTH', (_after - _before) * 1024)",   # ru_maxrss is in KiB on Linux
    ])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO), env=env)
    assert done.returncode == 0, f"snippet failed:\n{done.stdout}\n{done.stderr}"
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PEAK_GROWTH ")]
    assert lines, done.stdout
    return int(lines[-1].split()[1]), done.stdout
