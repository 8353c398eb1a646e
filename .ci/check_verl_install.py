"""docs/verl.md's install lines are what a clean venv needs: a new venv gets torch (TORCH_SPEC,
the first argument), numpy and pytest, then exactly the docs' pip commands, then runs
tests/integrations/test_verl.py and test_verl_losses.py (torch backend) against this checkout
with nothing skipped. The docs' commands must equal glm_kernels.integrations.verl.INSTALL_HINT
(the ImportError's advice, defined in integrations/verl/losses.py). ``--install`` only sets the
venv up (CI builds it beside the other venvs) and ``--test`` only runs the tests in it.
Usage: python .ci/check_verl_install.py [--install | --test] TORCH_SPEC [VENV_DIR]
"""
import ast
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def docs_commands():
    with open(os.path.join(ROOT, "docs", "verl.md")) as f:
        text = f.read()
    block = re.search(r"^Install\b.*?```\n(.*?)```", text, re.S | re.M)
    if block is None:
        sys.exit("check_verl_install: docs/verl.md has no Install code block")
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def install_hint():
    """INSTALL_HINT read from the source (importing the module needs verl)."""
    with open(os.path.join(ROOT, "glm_kernels", "integrations", "verl", "losses.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "INSTALL_HINT":
            return [shlex.split(part) for part in ast.literal_eval(node.value).split(" && ")]
    sys.exit("check_verl_install: INSTALL_HINT not found")


def run(args, **kwargs):
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True, **kwargs)


def install(torch_spec, venv):
    commands = docs_commands()
    if commands != install_hint():
        sys.exit(f"check_verl_install: docs/verl.md {commands} != INSTALL_HINT {install_hint()}")
    if not all(c[:2] == ["pip", "install"] for c in commands):
        sys.exit(f"check_verl_install: only pip install lines expected, got {commands}")
    run([sys.executable, "-m", "venv", "--clear", venv])
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip"]
    run(pip + ["install", "-q", torch_spec, "numpy", "pytest"])
    for command in commands:
        run(pip + command[1:] + ["-q"])


def test(venv):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("GLM_KERNELS_BACKEND", None)
    # the torch backend: a CPU torch brings no triton, and the docs' lines add none
    proc = subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pytest", "-q", "-rs",
                           "-k", "not interpret", "tests/integrations/test_verl.py",
                           "tests/integrations/test_verl_losses.py"],
                          cwd=ROOT, env=env,
                          capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    if proc.returncode != 0 or "skipped" in proc.stdout:
        sys.exit("check_verl_install: tests/integrations/test_verl{,_losses}.py failed or "
                 "skipped in a venv set up with docs/verl.md's install lines")


if __name__ == "__main__":
    args = sys.argv[1:]
    phase = args.pop(0)[2:] if args and args[0] in ("--install", "--test") else "all"
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    venv_dir = args[1] if len(args) == 2 else os.path.join(ROOT, "build", "verl-venv")
    if phase in ("install", "all"):
        install(args[0], venv_dir)
    if phase in ("test", "all"):
        test(venv_dir)
