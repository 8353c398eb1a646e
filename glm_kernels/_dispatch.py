"""Backend choice and the batch-invariance switch: the two per-call settings every op reads
(each from an environment variable, overridable per thread in a ``with`` block).

Argument checks live in ``_checks.py``, bounded JSON parsing in ``_json.py``.

Three backends (docs/design.md section 2):

* ``triton``    -- CUDA tensors and Triton importable: the fast path.
* ``interpret`` -- the same Triton kernels run by Triton's interpreter on CPU tensors:
  ``GLM_KERNELS_BACKEND=interpret`` selects it for every op. ``TRITON_INTERPRET=1`` alone only
  makes the kernels interpretable (Triton decides at decoration time whether a
  ``@triton.jit`` function is compiled or interpreted, so it must be set before the kernels
  are first imported); CPU tensors then still default to ``torch`` and
  ``force_backend("interpret")`` selects the interpreter.
* ``torch``     -- the plain PyTorch reference (``_reference.py``): CPU default, and any
  device where Triton is missing.

``GLM_KERNELS_BACKEND=torch|triton|interpret`` forces one for the whole process;
:func:`force_backend` forces one inside a ``with`` block (tests and benchmarks use it).
A fallback from ``triton`` to ``torch`` is logged once per op, never silent.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import Iterator, Optional

import torch

from ._checks import check_bool

BACKENDS = ("torch", "triton", "interpret")
_ENV = "GLM_KERNELS_BACKEND"

logger = logging.getLogger("glm_kernels")

_env_backend = os.environ.get(_ENV, "").strip().lower() or None
if _env_backend is not None and _env_backend not in BACKENDS:
    raise ValueError(f"{_ENV}={_env_backend!r}: expected one of {BACKENDS}")
if _env_backend == "interpret":
    # Must precede the first import of any module that defines @triton.jit kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_BATCH_INVARIANT_ENV = "GLM_KERNELS_BATCH_INVARIANT"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_env_batch_invariant = os.environ.get(_BATCH_INVARIANT_ENV, "").strip().lower()
if _env_batch_invariant not in _TRUE + _FALSE:
    raise ValueError(f"{_BATCH_INVARIANT_ENV}={_env_batch_invariant!r}: expected 1 or 0")
_env_batch_invariant = _env_batch_invariant in _TRUE

_local = threading.local()
_warned: set = set()


# The oldest Triton whose compiler and interpreter run every kernel here: 3.4, what torch 2.8
# pins (what 3.4 lacks, `triton.constexpr_function`, comes from _triton_compat). 3.3 (torch
# 2.7) lacks interpreter builder ops the kernels use.
TRITON_MIN = (3, 4)
# The oldest torch whose pinned Triton (CUDA builds on Linux) is at least TRITON_MIN.
TORCH_WITH_TRITON_MIN = (2, 8)
# Triton < 3.7's interpreter turns a loaded scalar (a 1-element array) into a Python int with
# int(array), which numpy >= 2.3 refuses: every kernel that loops to a loaded bound fails.
_INTERPRETER_NUMPY_FIXED = (3, 7)


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def triton_unavailable_reason() -> Optional[str]:
    """None when the Triton kernels can run; otherwise why not (logged with each fallback)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising at import
        return (f"Triton is not importable ({type(exc).__name__}: {exc}; "
                f"{_triton_install_advice()})")
    if _version(triton.__version__) < TRITON_MIN:
        floor = ".".join(map(str, TRITON_MIN))
        return (f"Triton {triton.__version__} is older than {floor}, the oldest the kernels "
                f"support ({_triton_install_advice()})")
    return None


def _triton_install_advice() -> str:
    """What installs beside the user's torch: a torch that pins Triton (CUDA builds on Linux)
    refuses any other Triton, so the advice is then a newer torch, never a bare triton."""
    import importlib.metadata
    floor, torch_floor = (".".join(map(str, v)) for v in (TRITON_MIN, TORCH_WITH_TRITON_MIN))
    try:
        requires = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    pins = [r.split(";")[0].replace(" ", "") for r in requires
            if r.replace(" ", "").startswith("triton==")]
    if not pins:
        return f"pip install 'triton>={floor}'"
    pinned = pins[0][len("triton=="):]
    if _version(pinned) >= TRITON_MIN:
        return f"pip install 'triton=={pinned}', the Triton torch {torch.__version__} pins"
    return (f"torch {torch.__version__} pins triton {pinned}: pip install 'torch>={torch_floor}', "
            f"which brings a Triton >= {floor}")


def triton_available() -> bool:
    return triton_unavailable_reason() is None


def torch_version() -> tuple:
    """(major, minor, patch) of torch, for the few places a torch release's bug is avoided."""
    return _version(torch.__version__)


@functools.lru_cache(maxsize=None)
def triton_version() -> tuple:
    """(major, minor, patch) of the importable Triton, (0, 0, 0) without one. Launch parameters
    that a Triton release's codegen needs are keyed on this, each in its kernel module."""
    try:
        import triton
    except Exception:
        return (0, 0, 0)
    return _version(triton.__version__)


@functools.lru_cache(maxsize=None)
def interpreter_unavailable_reason() -> Optional[str]:
    """None when Triton's interpreter can run the kernels on CPU tensors; otherwise why not."""
    reason = triton_unavailable_reason()
    if reason is not None:
        return reason
    import numpy
    import triton
    if (_version(triton.__version__) < _INTERPRETER_NUMPY_FIXED
            and _version(numpy.__version__) >= (2, 3)):
        return (f"Triton {triton.__version__}'s interpreter cannot run these kernels with numpy "
                f"{numpy.__version__} (it converts 1-element arrays to Python ints, which numpy "
                ">= 2.3 refuses): install numpy<2.3 or triton>=3.7")
    return None


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


_interpret_at_import = _interpret_env()


def interpreter_active() -> bool:
    """True when @triton.jit kernels defined from now on run in Triton's interpreter."""
    if torch.compiler.is_compiling():
        # torch 2.4's dynamo cannot trace os.environ.get; the value set before import (the
        # documented contract) stands in while a graph is traced.
        return _interpret_at_import
    return _interpret_env()


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), in plain integer steps that torch.compile
    traces on every supported torch (torch 2.4's dynamo cannot trace int.bit_length)."""
    power = 1
    while power < n:
        power *= 2
    return power


def _forced() -> Optional[str]:
    return getattr(_local, "backend", None) or _env_backend


@contextlib.contextmanager
def _thread_setting(attr: str, value) -> Iterator[None]:
    """This thread's ``attr`` is ``value`` inside the block, its previous value after."""
    previous = getattr(_local, attr, None)
    setattr(_local, attr, value)
    try:
        yield
    finally:
        setattr(_local, attr, previous)


def force_backend(name: str):
    """Force ``name`` for every op called in this thread inside the block."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: expected one of {BACKENDS}")
    return _thread_setting("backend", name)


def batch_invariant_switch(enabled: bool):
    """The thread-local switch alone (the library's own ops read it through
    :func:`batch_invariant_enabled`); ``glm_kernels.batch_invariant`` (in
    ``glm_kernels.invariant``) enters it together with the whole-model aten override."""
    return _thread_setting("batch_invariant", enabled)


def batch_invariant_enabled() -> bool:
    """Whether :func:`batch_invariant` (or ``GLM_KERNELS_BATCH_INVARIANT=1``) is in force."""
    local = getattr(_local, "batch_invariant", None)
    return _env_batch_invariant if local is None else local


def warn_once(key: str, message: str) -> None:
    """Log ``message`` at WARNING level the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def fallbacks_logged() -> list:
    """The keys of every warn_once message so far (benchmarks print them next to timings)."""
    return sorted(_warned)


def select_backend(op: str, *tensors: Optional[torch.Tensor]) -> str:
    """The backend that runs ``op`` on these tensors (None entries are ignored)."""
    present = [t for t in tensors if t is not None]
    on_cuda = any(t.is_cuda for t in present)
    forced = _forced()
    if forced == "torch":
        return "torch"
    if forced == "interpret":
        if on_cuda:
            raise ValueError(f"{op}: the interpret backend runs on CPU tensors, got CUDA tensors")
        reason = interpreter_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"{op}: backend 'interpret' cannot run: {reason}")
        if not interpreter_active():
            raise RuntimeError(
                f"{op}: backend 'interpret' needs TRITON_INTERPRET=1 (or "
                f"{_ENV}=interpret) set before glm_kernels is imported")
        return "interpret"
    if forced == "triton":
        if not on_cuda:
            raise ValueError(f"{op}: backend 'triton' needs CUDA tensors")
        if not triton_available():
            raise RuntimeError(f"{op}: backend 'triton' forced but {triton_unavailable_reason()}")
        return "triton"
    if on_cuda:
        if triton_available() and not interpreter_active():
            return "triton"
        why = triton_unavailable_reason() or "TRITON_INTERPRET=1 is set"
        warn_once(f"fallback:{op}", f"glm_kernels.{op}: {why}; CUDA tensors use the torch "
                                    "reference (slow path)")
    return "torch"
