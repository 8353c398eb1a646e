"""Whole-model batch invariance: an aten-level override that ``glm_kernels.batch_invariant()``
(and ``GLM_KERNELS_BATCH_INVARIANT=1``) enters, so the ops a transformers causal LM runs give
each row bits independent of the batch size, its position, left or right padding, the other
rows' lengths, the thread count, and whole-sequence vs KV-cache decode. Models are not edited.

How: kernels registered on the ``ADInplaceOrView`` dispatch key (below autograd, above the
backends; ``_registry.py``) while some thread is inside the block, answering in each thread
whose switch is on; only these ops and the reported ones pay a Python call. Inside
``torch.inference_mode()`` (tensors without that key) the same answers come from a
``TorchDispatchMode``, which every op reaches. The ops replaced (their math:
``_reference.py``)::

    mm, addmm, _grouped_mm           fixed 16-row tiles (a decode step's rows padded into one)
    bmm                              splits of 64 from each row's first non-zero, fixed-shape
                                     products, a tree over splits (``_torch.py``); a row of at
                                     most 16 terms: a tree over its non-zero products
    _softmax, _log_softmax           exact max, tree over the non-zero exponentials
    sum.dim_IntList, sum, mean.dim,  fixed trees (fp32 for 16-bit inputs)
      mean, native_layer_norm
    _scaled_dot_product_flash_attention_for_cpu, and on CUDA _scaled_dot_product_flash_,
      _efficient_ and _cudnn_attention (their return layouts: ``_fused_sdpa.py``)
                                     fixed splits of 64 keys from each query's first visible
                                     key, each a fixed-shape product, merged by a fixed tree
                                     (causal, padded, KV cache: ``_torch.py``); another mask:
                                     trees over D and over the unmasked keys
    rsqrt, silu, sigmoid, softplus,  every element through ATen's vector body (the scalar
      exp, log, tanh, sin, cos, ...  tail rounds some of them differently)

Every other op runs unchanged; one that reduces or multiplies matrices (``cumsum``, ``baddbmm``,
an attention call with dropout, ...) and is not covered is reported once by name through the
``glm_kernels`` logger, never silently non-invariant. The library's own custom ops
(``glm_kernels::``, what ``apply_glm_kernels`` installs) run their bodies on torch's kernels
and read the same switch themselves; another namespace's custom op is not the library's, and
the aten ops its body runs are answered like the model's.

Backends (``glm_kernels.force_backend``): on CPU the torch definitions; on CUDA (and under the
``interpret`` backend on CPU) mm / addmm / grouped_mm run the persistent fixed-tile Triton
matmul and every sdpa op above the fixed-split-KV Triton attention (a mask that is not one
key range per query falls back to the torch definition, logged once); eager attention's bmm
and softmax are covered on both. Not measured on GPU.
"""
import contextlib
import threading
from typing import Callable, Dict, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from .._dispatch import batch_invariant_enabled, select_backend, warn_once
from . import _fused_sdpa
from . import _reference as ref
from . import _torch as split_kv
from ._registry import PASS_THROUGH, Registration, decomposes, registrable, tensors_in

aten = torch.ops.aten


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A handler's answer for a form of its op that is batch-level by definition: run torch's.
_PASS_THROUGH = object()


def _kernel_backend(op: str, *tensors) -> str:
    """'triton' / 'interpret' when the Triton kernels run ``op`` on these tensors, else
    'torch' (the reference; the CPU default)."""
    backend = select_backend(f"batch_invariant.{op}", *tensors)
    if backend != "torch" and any(t.dtype not in _KERNEL_DTYPES or t.dtype != tensors[0].dtype
                                  for t in tensors):
        warn_once(f"batch_invariant:{op}:dtype", f"glm_kernels.batch_invariant(): {op} on "
                  f"{[str(t.dtype) for t in tensors]} runs the torch definition (the kernel "
                  "takes one of fp32/bf16/fp16 for every operand)")
        return "torch"
    return backend


def _programs(device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _mm(a, b):
    backend = _kernel_backend("mm", a, b)
    if backend == "torch":
        return ref.mm(a, b)
    from . import _kernels
    out = a.new_empty(a.shape[0], b.shape[1])
    _kernels.matmul(a, b, out, num_programs=_programs(a.device),
                    interpret=backend == "interpret")
    return out


def _addmm(bias, a, b, *, beta=1, alpha=1):
    return ref.addmm(bias, a, b, beta, alpha, mm=_mm)


def _grouped_mm(x, weight, offs=None, bias=None, out_dtype=None):
    if offs is not None and x.dim() == 2 and weight.dim() == 2:
        # Per-group x^T @ grad: the experts' weight gradient, a sum over the batch's tokens
        # (batch-dependent by definition, as every weight gradient): torch's kernel.
        return _PASS_THROUGH
    if offs is None or x.dim() != 2 or weight.dim() != 3:
        return NotImplemented
    if _kernel_backend("grouped_mm", x, weight) == "torch":
        return ref.grouped_mm(x, weight, offs, bias, out_dtype)
    return ref.grouped_mm(x, weight, offs, bias, out_dtype, mm=_mm)


def _attention(q, k, v, attn_mask, is_causal, scale):
    """(out [B, H, T, Dv] in q's dtype, logsumexp [B, H, T]) on fixed key splits: the Triton
    kernel where it runs, else the torch path; a mask that is not one key range per query
    takes the torch definition (logged once)."""
    backend = _kernel_backend("attention", q, k, v)
    ranges = ref.visible_key_ranges(q.shape[0], q.shape[2], k.shape[2], attn_mask, is_causal,
                                    q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if ranges is None:
        warn_once("batch_invariant:attention:mask", "glm_kernels.batch_invariant(): an "
                  "attention mask that is not one key range per query runs the torch "
                  "definition (memory O(T * L * D))")
        return ref.attention(q, k, v, attn_mask, is_causal, scale)
    if backend == "torch":
        return split_kv.attention(q, k, v, *ranges, scale)
    from . import _kernels
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    _kernels.attention(q.contiguous(), k.contiguous(), v.contiguous(), *ranges, out, lse, scale)
    return out, lse


def _sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if dropout_p != 0.0:
        return NotImplemented        # dropout draws per batch layout: reported, run as is
    return _attention(q, k, v, attn_mask, is_causal, scale)


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    return ref.sum_dims(x, dim, keepdim, dtype)


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    return ref.mean_dims(x, dim, keepdim, dtype)


def _elementwise(op) -> Callable:
    return lambda x, *args, **kwargs: ref.elementwise(op, x, *args, **kwargs)


# Transcendental elementwise ops: ATen's vector and scalar paths may round them differently.
_ELEMENTWISE = ("rsqrt", "silu", "sigmoid", "softplus", "gelu", "exp", "exp2", "expm1", "log",
                "log1p", "log2", "tanh", "sin", "cos", "erf", "mish", "elu", "logit")

COVERED: Dict[object, Callable] = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: split_kv.bmm,
    aten._softmax.default: lambda x, dim, half: ref.softmax(x, dim, half),
    aten._log_softmax.default: lambda x, dim, half: ref.softmax(x, dim, half, log=True),
    aten.sum.dim_IntList: _sum,
    aten.sum.default: lambda x, *, dtype=None: ref.sum_dims(x, None, False, dtype),
    aten.mean.dim: _mean,
    aten.mean.default: lambda x, *, dtype=None: ref.mean_dims(x, None, False, dtype),
    aten.native_layer_norm.default: ref.layer_norm,
}
# Ops newer than the torch floor (2.4 has no _grouped_mm) are covered where they exist.
for _name, _impl in (("_grouped_mm", _grouped_mm),
                     ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu)):
    if hasattr(aten, _name):
        COVERED[getattr(aten, _name).default] = _impl
for _name in _fused_sdpa.OPS:                   # CUDA's sdpa kernels: the same fixed splits
    _impl = _fused_sdpa.handler(_name, _attention)
    if _impl is not None:
        COVERED[getattr(aten, _name).default] = _impl
def _into_out(impl: Callable) -> Callable:
    """The ``.out`` overload of a covered op: the same result, copied into ``out``."""
    def run(*args, out, **kwargs):
        return out.copy_(impl(*args, **kwargs))
    return run


# The library's own tiled products call torch.mm(..., out=) on exact tiles (same bits here).
COVERED.update({aten.mm.out: _into_out(_mm), aten.bmm.out: _into_out(split_kv.bmm),
                aten.addmm.out: _into_out(_addmm)})
def _in_place(op) -> Callable:
    def run(x, *args, **kwargs):
        return x.copy_(ref.elementwise(op, x, *args, **kwargs))
    return run


for _name in _ELEMENTWISE:
    _packet = getattr(aten, _name, None)
    if _packet is not None and "default" in _packet.overloads():
        COVERED[_packet.default] = _elementwise(_packet.default)
        _in_place_packet = getattr(aten, _name + "_", None)      # nn.SiLU(inplace=True)
        if _in_place_packet is not None and "default" in _in_place_packet.overloads():
            COVERED[_in_place_packet.default] = _in_place(_packet.default)

# Ops that reduce or multiply along a dimension a batch can change and that the mode does not
# cover: reported once by name when one runs on floating-point tensors inside the context.
UNCOVERED_REDUCTIONS = frozenset((
    "mm", "addmm", "bmm", "_grouped_mm", "sum", "mean", "_softmax", "_log_softmax",
    "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "matmul", "linear", "einsum",
    "prod", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm", "logsumexp",
    "cumsum", "cumprod", "logcumsumexp", "nansum", "trace", "_scaled_mm", "_int_mm",
    "convolution", "_convolution", "native_group_norm", "native_batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "_fused_rms_norm",
    "embedding_bag", "_embedding_bag", "scatter_add", "scatter_reduce", "index_reduce",
    "nll_loss_forward", "nll_loss2d_forward", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_efficient_attention_forward",
    "_flash_attention_forward", "_scaled_dot_product_flash_attention_for_cpu",
))


def _has_float_tensor(args, kwargs) -> bool:
    return any(t.is_floating_point() for t in tensors_in(args, kwargs))


_candidates: Dict[object, bool] = {}


def _reported(func) -> bool:
    candidate = _candidates.get(func)
    if candidate is None:
        candidate = _candidates[func] = (func.namespace == "aten" and
                                         func.overloadpacket.__name__ in UNCOVERED_REDUCTIONS)
    return candidate


def report_uncovered(func, kwargs) -> None:
    """Log ``func`` (called on floats) once if it is a reduction or matrix op the override
    leaves as is."""
    if not _reported(func):
        return
    dtype = kwargs.get("dtype")
    if dtype is not None and not dtype.is_floating_point:
        return      # an integer result (cumsum of counts into int32) is exact
    warn_once(f"batch_invariant:uncovered:{func}",
              f"glm_kernels.batch_invariant(): aten op {func} ran inside the context and is "
              "not covered by the whole-model override: its rows may depend on the batch")


def answer(func, args, kwargs):
    """The override's result for one call of ``func`` on floating-point tensors, or
    ``PASS_THROUGH`` (torch's kernel runs it; reported first when it is an uncovered
    reduction)."""
    impl = COVERED.get(func)
    if impl is not None:
        out = impl(*args, **kwargs)
        if out is _PASS_THROUGH:
            return PASS_THROUGH
        if out is not NotImplemented:
            return out
    report_uncovered(func, kwargs)
    return PASS_THROUGH


def _registered_ops() -> list:
    """The covered ops, every dispatcher overload of the reported ones, and the library's own
    custom ops: their kernels run torch's ops as they are (they read the switch themselves),
    which a kernel here gives them by passing the call down (the ops a kernel runs do not
    come back here). Another namespace's custom ops are not registered: the aten ops their
    bodies run are answered like any other."""
    ops = list(COVERED)
    for name in sorted(UNCOVERED_REDUCTIONS):
        packet = getattr(aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            if op not in COVERED and registrable(op):
                ops.append(op)
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        namespace, _, name = qualified.partition("::")
        # A mutable one has torch's own kernel here already, which does the same.
        if namespace == "glm_kernels" and not torch._C._dispatch_has_kernel_for_dispatch_key(
                qualified, "ADInplaceOrView"):
            name, _, overload = name.partition(".")
            ops.append(getattr(getattr(torch.ops.glm_kernels, name), overload or "default"))
    return ops


class BatchInvariantMode(TorchDispatchMode):
    """The override as a dispatch mode, for blocks entered inside ``torch.inference_mode()``
    (whose tensors the registered kernels never see): every op of the model reaches Python
    here, so it costs more. Answers while the thread's switch is on, passes through otherwise
    (so ``batch_invariant(False)`` inside the block switches it off)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not batch_invariant_enabled() or not _has_float_tensor(args, kwargs):
            return func(*args, **kwargs)
        if decomposes(func):
            # Under inference_mode a composite op (matmul, linear) reaches the mode whole:
            # its decomposition's ops come back here one by one.
            with self:
                return func.decompose(*args, **kwargs)
        out = answer(func, args, kwargs)
        return func(*args, **kwargs) if out is PASS_THROUGH else out


def _python_mode_covers() -> bool:
    return any(isinstance(m, BatchInvariantMode) for m in _get_current_dispatch_mode_stack())


REGISTRATION = Registration(_registered_ops, answer, _python_mode_covers)
_thread = threading.local()
_process_hold = False            # GLM_KERNELS_BATCH_INVARIANT=1: registered for the process


def mode_active() -> bool:
    """Whether the override is in force for this thread: entered by ``batch_invariant()`` here
    (switched on or off inside), or for the whole process by ``GLM_KERNELS_BATCH_INVARIANT``."""
    return _process_hold or getattr(_thread, "entered", False)


def hold_for_process() -> None:
    """``GLM_KERNELS_BATCH_INVARIANT=1`` at import: the kernels stay registered, and answer in
    every thread whose switch is on (the variable turns it on by default)."""
    global _process_hold
    if not _process_hold:
        REGISTRATION.acquire()
        _process_hold = True


@contextlib.contextmanager
def whole_model(setting, enabled: bool) -> Iterator[None]:
    """Enter ``setting`` (the thread-local switch) and, when ``enabled`` and not already in
    force on this thread, the aten override; everything is restored on exit."""
    with setting:
        if not enabled or mode_active():
            yield
            return
        _thread.entered = True
        try:
            if torch.is_inference_mode_enabled():
                with BatchInvariantMode():
                    yield
            else:
                REGISTRATION.acquire()
                try:
                    yield
                finally:
                    REGISTRATION.release()
        finally:
            _thread.entered = False
