"""What a newcomer's install meets: the sdist carries the license, docs and C++ sources; pip
builds a platform wheel with the host extension, or without a C++ compiler a pure-Python
py3-none-any wheel and a notice that a plain (not -v) pip install shows; both carry the
license; and glm_kernels imports and runs every public op where Triton is missing."""
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, **kwargs):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{args[:4]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """An sdist built from the files git would ship (tracked or not ignored), not from build
    outputs lying in the checkout."""
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout to list the tracked files")
    pytest.importorskip("pybind11")
    tree = tmp_path_factory.mktemp("tree")
    files = _run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others",
                  "--exclude-standard"]).stdout.split("\0")
    for name in filter(None, files):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):      # a file deleted in the work tree is not shipped
            os.makedirs(os.path.dirname(os.path.join(tree, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(tree, name))
    out = tmp_path_factory.mktemp("dist")
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    proc = _run([sys.executable, "-c", code], cwd=tree)
    name = proc.stdout.strip().splitlines()[-1]
    with open(os.path.join(out, "build.log"), "w") as f:     # test_sdist_build_is_clean
        f.write(proc.stdout + proc.stderr)
    return os.path.join(out, name)


def _pip(*args, env=None, cwd=None):
    return _run([sys.executable, "-m", "pip", *args, "--no-build-isolation", "--no-deps",
                 "--no-index", "--no-cache-dir"], env=env, cwd=cwd)


_PROBE = textwrap.dedent("""
    import os, sys
    # An editable install of the checkout (make venv) maps glm_kernels.* onto the checkout
    # through a meta-path finder: drop it, so only the installed copy under test is seen.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    import glm_kernels
    from glm_kernels.delta import _host_codec
    assert os.path.dirname(glm_kernels.__file__).startswith(sys.argv[1]), glm_kernels.__file__
    if _host_codec._ext is not None:
        assert _host_codec._ext.__file__.startswith(sys.argv[1]), _host_codec._ext.__file__
    print("ext" if _host_codec._ext is not None else "no-ext:" + _host_codec._EXT_ERROR)
""")


NO_COMPILER = {**os.environ, "CC": "/bin/false", "CXX": "/bin/false"}
NOTICE = "the C++ host codec (glm_kernels._host) was not built"


@pytest.fixture(scope="module")
def wheels(sdist, tmp_path_factory):
    """The wheels pip builds from the sdist with a compiler ("ext") and without one ("pure"),
    with pip's verbose build log of the second."""
    built = {}
    for kind, env in (("ext", None), ("pure", NO_COMPILER)):
        out = tmp_path_factory.mktemp(f"wheel-{kind}")
        log = _pip("wheel", "-v", "-w", str(out), sdist, env=env, cwd=str(out))
        (name,) = [n for n in os.listdir(out) if n.endswith(".whl")]
        built[kind] = os.path.join(out, name)
        built[kind + "_log"] = log.stdout + log.stderr
    return built


def _wheel_files(path):
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _tracked(prefix):
    out = _run(["git", "-C", ROOT, "ls-files", prefix]).stdout.split()
    assert out, f"git lists no files under {prefix}"
    return out


def test_sdist_ships_license_docs_and_sources(sdist):
    with tarfile.open(sdist) as tf:
        root = tf.getnames()[0].split("/")[0]
        names = {n[len(root) + 1:] for n in tf.getnames()}
        license_text = tf.extractfile(f"{root}/LICENSE").read()
    expected = {"LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in"}
    expected |= set(_tracked("docs/")) | set(_tracked("csrc/"))
    assert expected <= names, sorted(expected - names)
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        assert license_text == f.read()
    assert b"Apache License" in license_text and b"Version 2.0, January 2004" in license_text


def _sdist_names(sdist):
    with tarfile.open(sdist) as tf:
        root = tf.getnames()[0].split("/")[0]
        names = {n[len(root) + 1:] for n in tf.getnames() if tf.getmember(n).isfile()}
        pkg_info = tf.extractfile(f"{root}/PKG-INFO").read().decode()
    return names, pkg_info


def test_sdist_carries_what_the_readmes_commands_need_and_nothing_stray(sdist):
    """`make demo` and `make test` from an unpacked sdist: the Makefile, the example, every
    test (not only setuptools' default top-level tests/test*.py), the benchmarks and the CI
    scripts the Makefile calls; every file is one git tracks (no build output, no runs/)."""
    names, _ = _sdist_names(sdist)
    needed = {"Makefile", "benchmarks/aot_report.py", ".ci/check_verl_install.py", ".ci/run"}
    for prefix in ("examples/", "tests/", "benchmarks/", ".ci/", "glm_kernels/"):
        needed |= set(_tracked(prefix))
    assert needed <= names, sorted(needed - names)
    tracked = set(_run(["git", "-C", ROOT, "ls-files", "--cached", "--others",
                        "--exclude-standard"]).stdout.split())          # what the fixture ships
    generated = {"PKG-INFO", "setup.cfg"}
    stray = {n for n in names - tracked - generated if not n.startswith("glm_kernels.egg-info/")}
    assert not stray, sorted(stray)


def test_sdist_build_is_clean(sdist):
    with open(os.path.join(os.path.dirname(sdist), "build.log")) as f:
        log = f.read()
    assert "no files found matching" not in log and "warning: no previously" not in log, log


def test_metadata_markers_classifiers(sdist):
    _, pkg_info = _sdist_names(sdist)
    ray = [line for line in pkg_info.splitlines() if line.startswith("Requires-Dist: ray")]
    assert ray and all('python_version >= "3.10"' in line for line in ray), ray
    assert {"example", "integrations"} <= {line.split('extra == "')[1].rstrip('"')
                                           for line in ray}
    classifiers = {line.split(": ", 1)[1] for line in pkg_info.splitlines()
                   if line.startswith("Classifier: ")}
    assert "Programming Language :: Python :: 3.9" in classifiers     # requires-python's floor
    assert any(c.startswith("Topic :: ") for c in classifiers)
    assert any(c.startswith("Development Status :: ") for c in classifiers)


def test_wheel_carries_only_the_package(wheels):
    for kind in ("ext", "pure"):
        top = {n.split("/")[0] for n in _wheel_files(wheels[kind])}
        assert top == {"glm_kernels", "glm_kernels-0.1.0.dist-info"}, (kind, sorted(top))


def _probe_installed(wheel, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--target", str(target), wheel, cwd=str(tmp_path))
    return _run([sys.executable, "-c", _PROBE, str(target)], cwd=str(tmp_path),
                env={**os.environ, "PYTHONPATH": str(target)}).stdout.strip()


def test_wheel_with_the_extension(wheels, tmp_path):
    name = os.path.basename(wheels["ext"])
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert f"-{py}-{py}-" in name and not name.endswith("-any.whl"), name
    files = _wheel_files(wheels["ext"])
    assert any(n.startswith("glm_kernels/_host") and n.endswith(".so") for n in files), \
        sorted(files)
    assert "Root-Is-Purelib: false" in files["glm_kernels-0.1.0.dist-info/WHEEL"].decode()
    assert b"Apache License" in files["glm_kernels-0.1.0.dist-info/licenses/LICENSE"]
    assert _probe_installed(wheels["ext"], tmp_path) == "ext"


def test_wheel_without_a_compiler_is_pure_python(wheels, tmp_path):
    assert os.path.basename(wheels["pure"]) == "glm_kernels-0.1.0-py3-none-any.whl"
    assert NOTICE in wheels["pure_log"]
    files = _wheel_files(wheels["pure"])
    assert not [n for n in files if n.endswith((".so", ".pyd"))]
    assert "Root-Is-Purelib: true" in files["glm_kernels-0.1.0.dist-info/WHEEL"].decode()
    assert b"Apache License" in files["glm_kernels-0.1.0.dist-info/licenses/LICENSE"]
    # the package is whole: every module the extension build would ship beside _host
    ext_modules = {n for n in _wheel_files(wheels["ext"]) if n.endswith(".py")}
    assert ext_modules == {n for n in files if n.endswith(".py")}
    assert _probe_installed(wheels["pure"], tmp_path) == "no-ext:the C++ host codec was not built"


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux script (a pty)")
def test_plain_pip_install_shows_the_no_compiler_notice(sdist, tmp_path):
    """No -v: pip hides a successful build's output, the notice reaches the user's terminal."""
    target = tmp_path / "site"
    command = " ".join(shlex.quote(a) for a in [
        sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
        "--no-index", "--no-cache-dir", "--target", str(target), sdist])
    proc = subprocess.run(["script", "-qec", command, "/dev/null"], capture_output=True,
                          text=True, timeout=300, env=NO_COMPILER, cwd=str(tmp_path),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert NOTICE in proc.stdout, proc.stdout[-3000:]
    assert "Successfully installed glm_kernels" in proc.stdout


_NO_TRITON = textwrap.dedent("""
    import sys

    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("no module named triton (blocked by the test)")

    sys.meta_path.insert(0, NoTriton())
    import torch
    import glm_kernels
    from glm_kernels import _dispatch, delta, optim

    assert not _dispatch.triton_available()
    assert "not importable" in _dispatch.triton_unavailable_reason()
    torch.manual_seed(0)
    T, V = 6, 11
    lp = torch.randn(T).mul(0.1).sub(1).requires_grad_()
    rollout = lp.detach() + 0.05 * torch.randn(T)
    adv = torch.randn(T)
    glm_kernels.icepop_loss(lp, rollout, adv).backward()
    logits = torch.randn(T, V, requires_grad=True)
    ids = torch.randint(0, V, (T,))
    glm_kernels.selective_logprobs(logits, ids).sum().backward()
    glm_kernels.icepop_loss_from_logits(logits, ids, rollout, adv).backward()
    hidden, weight = torch.randn(T, 8, requires_grad=True), torch.randn(V, 8)
    glm_kernels.fused_linear_icepop_loss(hidden, weight, ids, rollout, adv).backward()
    glm_kernels.reverse_kl_from_logits(logits, torch.randn(T, V)).sum().backward()
    glm_kernels.group_advantages(torch.randn(8), group_size=4)
    glm_kernels.opd_advantages(rollout, rollout + 0.1, form="log_ratio")
    glm_kernels.newton_schulz(torch.randn(2, 8, 12))
    glm_kernels.muon_split_orthogonalize(torch.randn(2 * 5, 12), glm_kernels.HeadSplit(2, [3, 2]))
    glm_kernels.topk(torch.randn(3, 50), 4)
    glm_kernels.moe_route(torch.randn(5, 16), 2)
    new, old = torch.randn(100), torch.randn(100)
    target = old.clone()
    delta.apply_(target, delta.encode(new, old))
    assert torch.equal(target.view(torch.int32), new.view(torch.int32))
    model = torch.nn.Linear(8, 8)
    opt = optim.MuonSplit([{"params": [model.weight], "use_muon": True},
                           {"params": [model.bias], "use_muon": False}], lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert "triton" not in sys.modules
    print("every op ran without triton")
""")


def test_every_op_runs_without_triton():
    env = {k: v for k, v in os.environ.items() if k not in ("GLM_KERNELS_BACKEND",
                                                           "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**env, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every op ran without triton" in proc.stdout
