"""pip's resolution of this package's extras beside the torch already installed, without
installing anything (pip install --dry-run): fails if pip would replace torch, its pinned
triton or one of torch's CUDA libraries. Usage: python .ci/check_extras.py EXTRA [EXTRA ...]
"""
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTECTED = ("torch", "triton")     # and nvidia-* (the CUDA libraries a torch build pins)


def installed(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(extras):
    if not extras:
        sys.exit(__doc__)
    torch_version = installed("torch")
    if torch_version is None:
        sys.exit("check_extras: no torch installed here; the check is about keeping one")
    spec = f"{ROOT}[{','.join(extras)}]"
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-q",
                               "--no-build-isolation", "--report", report, spec],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"check_extras: pip cannot resolve {spec} beside torch {torch_version}:\n"
                     f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(report) as f:
            planned = [(item["metadata"]["name"].lower(), item["metadata"]["version"])
                       for item in json.load(f)["install"]]
    moved = [f"{name} {installed(name) or '(absent)'} -> {version}" for name, version in planned
             if name in PROTECTED or name.startswith("nvidia-")]
    others = ", ".join(f"{n}=={v}" for n, v in planned if n != "glm-kernels") or "nothing"
    print(f"check_extras: [{','.join(extras)}] beside torch {torch_version} (triton "
          f"{installed('triton')}), Python {sys.version.split()[0]}: would install {others}")
    if moved:
        sys.exit("check_extras: the extras would replace: " + "; ".join(moved))


if __name__ == "__main__":
    main(sys.argv[1:])
