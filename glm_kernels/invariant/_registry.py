"""How the whole-model override reaches aten ops: kernels registered on the ``ADInplaceOrView``
dispatch key while some thread is inside ``glm_kernels.batch_invariant()``.

``ADInplaceOrView`` sits below autograd and above the backends: an op that a covered kernel
answers is still recorded by autograd with torch's own derivative (whose products come back
here), and a kernel that declines hands the call to the backend below (``redispatch``) with
nothing changed, so the kernel computes torch's own result without an ``.out`` twin. Only the
covered and the reported ops pay a Python call; every other op runs as it would outside (a
``TorchDispatchMode`` sends every op of a model through Python: 1.9-2.6x a tiny model's time
before any work, against 1.3-1.4x here; docs/batch_invariance.md).

The registration is process-wide and counted: the first thread to enter registers, the last
to leave removes every kernel (aten's own ``ADInplaceOrView`` kernels of out= and in-place ops
come back). Each kernel answers only while *its* thread's switch is on
(``batch_invariant_enabled()``), so other threads get torch's result. Inside a kernel,
``AutoDispatchBelowADInplaceOrView`` keeps the kernel's own ops (the tiles, the trees) from
coming back here, as torch's generated kernels do, and the kernel bumps the version counter
of what an out= or in-place op wrote, as the kernel it overrides did.

Not reached this way: ops on tensors made under ``torch.inference_mode()`` (they carry no
``ADInplaceOrView`` key), so ``whole_model`` uses a ``TorchDispatchMode`` when entered inside
``inference_mode``. Passed to torch as they come: tensor subclasses that dispatch in Python
(a wrapper subclass calls the op again on its plain tensors, answered then; fake and
functional tensors mean a graph is being traced, logged once: what the compiler generates
itself is not covered).
"""
import threading
import warnings
from typing import Callable, Dict

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .._dispatch import batch_invariant_enabled, warn_once

_BELOW = torch._C._after_ADInplaceOrView_keyset
_PYTHON_KEY = torch._C.DispatchKey.Python
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_TRACING = (FakeTensor, FunctionalTensor)
# ``answer``'s result for a call the override leaves to torch's kernel.
PASS_THROUGH = object()


def qualified_name(op) -> str:
    """``aten::mm`` / ``aten::mm.out``: how ``torch.library`` names an overload."""
    overload = op._overloadname
    return op._schema.name + ("" if overload == "default" else "." + overload)


def _written(op) -> Callable:
    """args, kwargs -> the tensors ``op`` writes (its out= or in-place arguments)."""
    places = [(i, a.name) for i, a in enumerate(op._schema.arguments)
              if a.alias_info is not None and a.alias_info.is_write]

    def written(args, kwargs):
        found = []
        for index, name in places:
            value = args[index] if index < len(args) else kwargs.get(name)
            found.extend(value if isinstance(value, (list, tuple)) else [value])
        return [t for t in found if isinstance(t, torch.Tensor)]
    return written


def tensors_in(args, kwargs):
    """The tensors among ``args`` and ``kwargs``, inside lists and tuples too."""
    flat = list(args) + list(kwargs.values())
    for a in flat:
        if isinstance(a, (list, tuple)):
            flat.extend(a)
        elif isinstance(a, torch.Tensor):
            yield a


def _answerable(args, kwargs, keyset, python_mode_covers) -> bool:
    """Some argument is a floating-point tensor with real data: none on the meta device, and,
    when the call went through the Python key, no tensor subclass that dispatches in Python
    (fake tensors while tracing, functional tensors: their own dispatch unwraps them and calls
    the op again on plain tensors, answered then) and no override mode below that answers."""
    tensors, has_float, subclass = list(tensors_in(args, kwargs)), False, False
    for a in tensors:
        if a.is_meta:
            return False
        has_float = has_float or a.is_floating_point()
        subclass = subclass or type(a) not in _PLAIN
    if not has_float:
        return False
    if keyset.has(_PYTHON_KEY) and subclass:
        if any(isinstance(a, _TRACING) for a in tensors):
            warn_traced()
        return False
    return not (keyset.has(_PYTHON_KEY) and python_mode_covers())


def _kernel(op, answer: Callable, python_mode_covers: Callable[[], bool]) -> Callable:
    written = _written(op) if op._schema.is_mutable else None

    def kernel(keyset, *args, **kwargs):
        out = PASS_THROUGH
        if batch_invariant_enabled() and _answerable(args, kwargs, keyset, python_mode_covers):
            if torch.is_inference_mode_enabled():
                warn_inference_mode()
            with torch._C._AutoDispatchBelowADInplaceOrView():
                out = answer(op, args, kwargs)
        if out is PASS_THROUGH:
            with torch._C._AutoDispatchBelowADInplaceOrView():
                out = op.redispatch(keyset & _BELOW, *args, **kwargs)
        if written is not None:
            for tensor in written(args, kwargs):
                torch.autograd.graph.increment_version(tensor)
        return out
    return kernel


class Registration:
    """The override's kernels, registered while at least one holder is inside: ``ops()`` (read
    at each registration) names the ops, ``answer(op, args, kwargs)`` gives a call's result or
    PASS_THROUGH, ``python_mode_covers()`` says a dispatch mode below answers instead."""

    def __init__(self, ops: Callable, answer: Callable, python_mode_covers: Callable[[], bool]):
        self._ops, self._answer, self._python_mode_covers = ops, answer, python_mode_covers
        self._lock = threading.Lock()
        self._libraries: Dict[str, torch.library.Library] = {}      # one per namespace
        self.holders = 0

    def acquire(self) -> None:
        with self._lock:
            if self.holders == 0:
                try:
                    with warnings.catch_warnings():
                        # torch warns once that an out= / in-place op's kernel is overridden:
                        # that is the design (the module docstring), not a conflict.
                        warnings.filterwarnings("ignore", message="Warning only once for all op")
                        for op in self._ops():
                            self._register(op)
                except Exception:
                    self._remove()                     # nothing half-registered
                    raise
            self.holders += 1

    def release(self) -> None:
        with self._lock:
            self.holders -= 1
            if self.holders == 0:
                self._remove()

    def _register(self, op) -> None:
        if op.namespace not in self._libraries:
            self._libraries[op.namespace] = torch.library.Library(op.namespace, "IMPL")
        self._libraries[op.namespace].impl(
            qualified_name(op), _kernel(op, self._answer, self._python_mode_covers),
            "ADInplaceOrView", with_keyset=True)

    def _remove(self) -> None:
        for library in self._libraries.values():
            library._destroy()
        self._libraries = {}


_composite: Dict[object, bool] = {}


def decomposes(op) -> bool:
    """Whether ``op`` is decomposed above autograd (CompositeImplicitAutograd: matmul, linear);
    raises RuntimeError for an overload the dispatcher does not know (TorchScript-only)."""
    known = _composite.get(op)
    if known is None:
        known = _composite[op] = torch._C._dispatch_has_kernel_for_dispatch_key(
            qualified_name(op), "CompositeImplicitAutograd")
    return known


def registrable(op) -> bool:
    """Whether ``op`` is a dispatcher op a kernel on ADInplaceOrView would ever see (not a
    TorchScript-only overload, not one decomposed above autograd)."""
    try:
        return not decomposes(op)
    except RuntimeError:
        return False


def warn_traced() -> None:
    warn_once("batch_invariant:traced", "glm_kernels.batch_invariant(): a graph was traced "
              "inside the block (torch.compile, torch.export): the compiled graph's matrix "
              "products are answered (mm / addmm / bmm with out=), but the reductions and "
              "fused kernels it generates itself are not, so its rows may depend on the batch "
              "(run the model eagerly inside batch_invariant())")


def warn_inference_mode() -> None:
    warn_once("batch_invariant:inference_mode", "glm_kernels.batch_invariant(): "
              "torch.inference_mode() was entered inside the block: ops on tensors made "
              "there bypass the whole-model override, so their rows may depend on the batch "
              "(enter batch_invariant() inside inference_mode, or use torch.no_grad())")
