"""What the kernels need from Triton that its older releases (3.4, what torch 2.8 pins) lack,
written so that they do not need it. Imported only by kernel modules (Triton is importable).

``constexpr_function``: a plain Python function called at compile time on constexpr
arguments inside a ``@triton.jit`` function (``_log2(x.numel)``). Triton >= 3.5 has
``triton.constexpr_function``; 3.4's code generator calls any function marked as a Triton
builtin with a ``_semantic=`` keyword and its interpreter calls it as plain Python, so the
same contract is a marked wrapper: constexpr arguments unwrapped, a constexpr result when
compiling, the plain value when interpreting.
"""
import functools

import triton
import triton.language as tl


def constexpr_function(fn):
    if hasattr(triton, "constexpr_function"):
        return triton.constexpr_function(fn)

    @functools.wraps(fn)
    def call(*args, _semantic=None, **kwargs):
        unwrap = tl.core._unwrap_if_constexpr
        result = fn(*(unwrap(a) for a in args), **{k: unwrap(v) for k, v in kwargs.items()})
        return result if _semantic is None else tl.constexpr(result)

    setattr(call, tl.core.TRITON_BUILTIN, True)
    return call
