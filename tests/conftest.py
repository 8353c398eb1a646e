"""Shared test set-up: the interpreter is switched on before glm_kernels is imported, so every
Triton kernel can run on CPU tensors under the ``interpret`` backend."""
import atexit
import logging
import os
import shutil
import tempfile

# A private Inductor cache per test session: the default one (/tmp/torchinductor_<user>) is
# shared by every run on the machine, and a compiled graph cached before a custom op's fake
# kernel changed is replayed with the old fake's strides. The workers of one pytest-xdist
# session (direct children of the controller, which made the directory) share it: one worker
# then reuses a graph another compiled (the same op under the torch and the kernels' backend
# is the same graph: ~40 s of Inductor each on 2 cores, a cache hit in ~4 s). Inductor writes
# its cache entries atomically, so concurrent workers are safe. Any other process that finds
# a directory made by another pytest (a nested run) makes its own; one the user set is kept.
_CACHE_OWNER = "GLM_KERNELS_TEST_INDUCTOR_CACHE_PID"
_owner = os.environ.get(_CACHE_OWNER)
_from_controller = bool(os.environ.get("PYTEST_XDIST_WORKER")) and _owner == str(os.getppid())
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ or \
        (_owner is not None and _owner != str(os.getpid()) and not _from_controller):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="glm_kernels_inductor_")
    os.environ[_CACHE_OWNER] = str(os.getpid())
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import glm_kernels  # noqa: E402  (after TRITON_INTERPRET)
from glm_kernels import _dispatch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
KERNEL_BACKEND = "triton" if HAS_CUDA else "interpret"
DEVICE = "cuda" if HAS_CUDA else "cpu"


# First among the plug-ins: pytest-xdist's worker reads the ``xdist_group`` marks in its own
# hook (appending the group to each node id), so marks added after it are never seen and the
# "grouped" tests ran on both workers (module fixtures built twice, sandbox tests side by side).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if config.getoption("each_value_once"):
        items[:] = _each_value_once(config, items)
    _group_shared_fixtures(items)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption(
        "--each-value-once", action="store_true", default=False,
        help="of each parametrized test, run only the cases that bring a parameter value no "
             "case kept before it brought (every value of every parameter still runs, those "
             "on the Triton kernels first): make test-min's run of what older versions break")


def _runs_kernels(item) -> bool:
    spec = getattr(item, "callspec", None)
    return "kernel_backend" in getattr(item, "fixturenames", ()) or (
        spec is not None and KERNEL_BACKEND in [v for v in spec.params.values()
                                                if isinstance(v, str)])


def _each_value_once(config, items):
    """The cases of each test function that together run every value of each of its
    parameters at least once (a matrix of 8 presets x 4 modes x 2 backends becomes 8 cases,
    not 64), visiting the cases that run the Triton kernels first so the kernels keep every
    value. An older torch or Triton breaks an op, a kernel or one of their options; the
    product of the options is this project's logic, which ``make test`` runs whole."""
    covered: dict = {}
    keep = set()
    for item in sorted(items, key=lambda item: not _runs_kernels(item)):
        spec = getattr(item, "callspec", None)
        if spec is None:
            keep.add(item.nodeid)
            continue
        # by value: a list of tuples gives each case one index for all its names
        values = {(name, repr(value)) for name, value in spec.params.items()}
        seen = covered.setdefault((item.parent.nodeid, item.originalname), set())
        if not values <= seen:
            seen |= values
            keep.add(item.nodeid)
    dropped = [item for item in items if item.nodeid not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    return [item for item in items if item.nodeid in keep]


_SANDBOX_FILES = ("test_sandbox", "test_tora_task", "test_trainer_tora")


def _group_shared_fixtures(items):
    """pytest-xdist (``make test``: ``--dist loadgroup``) hands tests out one at a time, so two
    workers would each build a fixture the tests of one module share (a wheel build, a gloo
    world, compiled graphs). A test that uses a module-, class- or package-scoped fixture of
    this test tree runs in its module's group: one worker, the fixture built once. A test
    already in a group keeps it (the Ray tests' ``xdist_group("ray")``: one local Ray instance
    at a time, beside the engines' health pings and timings as in a serial run). The tests
    that run sandboxed snippets share one worker too: a fork bomb held at its process limit
    beside another worker's snippet made that snippet fail to start (exit 126)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        if os.path.basename(str(item.fspath)).startswith(_SANDBOX_FILES):
            item.add_marker(pytest.mark.xdist_group("sandbox"))
            continue
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d.baseid and d.scope in ("class", "module", "package")
               for seq in defs.values() for d in seq):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


class LazyKernels:
    """A Triton kernel module imported on first attribute access, so a test module imports
    where Triton is missing or older than the floor (its torch-backend tests still run; the
    kernel tests that touch this skip through ``kernel_backend`` first)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        import importlib
        return getattr(importlib.import_module(self._name), attr)


def skip_without_kernels() -> None:
    """Skip, naming the reason, where the Triton kernels cannot run here (no Triton, a Triton
    older than the floor, or an interpreter that cannot run with this numpy)."""
    reason = (_dispatch.triton_unavailable_reason() if HAS_CUDA
              else _dispatch.interpreter_unavailable_reason())
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def kernel_backend():
    """Run the test body with the Triton kernels (interpreter on CPU, compiled on GPU)."""
    skip_without_kernels()
    with glm_kernels.force_backend(KERNEL_BACKEND):
        yield KERNEL_BACKEND


@pytest.fixture(params=["torch", KERNEL_BACKEND])
def any_backend(request):
    """Run the test body once per backend."""
    if request.param != "torch":
        skip_without_kernels()
    with glm_kernels.force_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _glm_kernels_logger_as_found():
    """The example trainer's log set-up (some tests run it in-process) stops glm_kernels'
    records at its own handler; every test gets the logger back as it was before it."""
    logger = logging.getLogger("glm_kernels")
    propagate, handlers, level = logger.propagate, list(logger.handlers), logger.level
    yield
    logger.propagate, logger.handlers[:] = propagate, handlers
    logger.setLevel(level)
