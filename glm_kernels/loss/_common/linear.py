"""The chunked pass over tokens shared by the hidden-states ops (``fused_linear_icepop_loss``,
``fused_linear_logprobs``): logits = hidden @ weight^T one chunk of C tokens at a time, C from a
memory budget, so [tokens, V] never exists; the input checks and the chunk configuration."""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ... import _checks, _dispatch
from ... import _row_invariant as _invariant

DEFAULT_MEMORY_BUDGET = 512 << 20          # bytes for the [C, V] logits chunk
_CHUNK_MULTIPLE = 128                      # keeps the GEMM tiles full


@dataclass(frozen=True)
class FusedLinearConfig:
    """chunk_size: tokens per chunk; the [chunk_size, V] logits chunk is the only
    vocab-sized activation."""
    chunk_size: int


def make_fused_linear_config(n_tokens: int, vocab: int, dtype: torch.dtype, *,
                             chunk_size: Optional[int] = None,
                             memory_budget: Optional[int] = None,
                             fp32_temporaries: int = 0) -> FusedLinearConfig:
    """An explicit ``chunk_size`` wins; otherwise the largest multiple of 128 tokens (or all
    tokens) whose [C, V] chunk, plus ``fp32_temporaries`` [C, V] fp32 buffers of the backend
    that runs the pass, fits ``memory_budget`` bytes (default 512 MiB, e.g. 1664 tokens at
    V = 154880 in bf16 on the kernels)."""
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        return FusedLinearConfig(chunk_size)
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {budget!r}")
    row_bytes = vocab * (torch.empty(0, dtype=dtype).element_size() + 4 * fp32_temporaries)
    chunk = max(budget // row_bytes, 1)
    if chunk >= _CHUNK_MULTIPLE:
        chunk -= chunk % _CHUNK_MULTIPLE
    return FusedLinearConfig(int(max(min(chunk, n_tokens), 1)))


def check_linear_inputs(hidden: torch.Tensor, weight: torch.Tensor,
                        token_ids: torch.Tensor) -> None:
    """hidden [*S, H] fp32/bf16/fp16, weight [V, H] (V >= 1) of the same dtype, token_ids [*S]
    int32/int64, all on one device."""
    _checks.check_tensor("hidden", hidden, dtypes=(torch.float32, torch.bfloat16,
                                                     torch.float16))
    _checks.check_tensor("weight", weight, dtypes=(hidden.dtype,), ndim=(2,))
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden must be [*S, H] with H = weight.shape[1] = {weight.shape[1]}, "
                         f"got shape {tuple(hidden.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must be [V, H] with V >= 1, got shape "
                         f"{tuple(weight.shape)}")
    _checks.check_tensor("token_ids", token_ids, dtypes=(torch.int32, torch.int64))
    if token_ids.shape != hidden.shape[:-1]:
        raise ValueError(f"token_ids must have shape hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(token_ids.shape)}")
    _checks.check_same_device({"hidden": hidden, "weight": weight, "token_ids": token_ids})


def chunk_config(op: str, hidden: torch.Tensor, weight: torch.Tensor, *,
                 chunk_size: Optional[int], memory_budget: Optional[int],
                 torch_fp32_temporaries: int) -> FusedLinearConfig:
    """The chunking of one call: the budget counts the torch backend's [C, V] fp32 buffers
    (``torch_fp32_temporaries``) when ``op`` runs on that backend (the kernels hold none)."""
    on_torch = _dispatch.select_backend(op, hidden) == "torch"
    return make_fused_linear_config(
        max(hidden.shape[:-1].numel(), 1), weight.shape[0], weight.dtype, chunk_size=chunk_size,
        memory_budget=memory_budget, fp32_temporaries=torch_fp32_temporaries if on_torch else 0)


def chunked_linear_pass(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int,
                        fused_pass, *, need_grad_hidden: bool, need_grad_weight: bool,
                        fp32_weight_grad: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk loop shared by the fused-linear ops; returns (dL/dhidden [N, H] or [0],
    dL/dweight [V, H] or [0]).

    Per chunk of rows ``part``: logits_c = hidden[part] @ weight^T into one reused [C, V]
    buffer in the weight dtype, then ``fused_pass(part, logits_c)``, which reads logits_c and,
    when a gradient is asked for, writes dL/dlogits_c over it; then GEMM 2 and 3 turn that
    into the hidden and weight gradients. The weight gradient sums over chunks in the weight
    dtype, or with ``fp32_weight_grad`` in an fp32 [V, H] buffer rounded once at the end.
    """
    n = hidden.shape[0]
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else hidden.new_empty(0)
    accumulate_fp32 = need_grad_weight and fp32_weight_grad and weight.dtype != torch.float32
    grad_weight = (torch.zeros_like(weight, dtype=torch.float32 if accumulate_fp32 else None)
                   if need_grad_weight else weight.new_empty(0))
    chunk_buffer = torch.empty((min(chunk_size, n), weight.shape[0]), dtype=weight.dtype,
                               device=hidden.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        part = slice(start, end)
        hidden_c = hidden[part]
        logits_c = chunk_buffer[: end - start]
        _invariant.linear(hidden_c, weight, out=logits_c)
        fused_pass(part, logits_c)
        if need_grad_hidden:
            _invariant.linear(logits_c, weight.t(), out=grad_hidden[part])
        if accumulate_fp32:
            _addmm_fp32(grad_weight, logits_c.t(), hidden_c)
        elif need_grad_weight:
            grad_weight.addmm_(logits_c.t(), hidden_c)
    return grad_hidden, grad_weight.to(weight.dtype) if accumulate_fp32 else grad_weight


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b into fp32 ``acc`` from bf16/fp16 a, b without rounding the product to
    their dtype first (on CUDA, torch >= 2.8: the GEMM's own out_dtype; else upcast copies)."""
    if acc.is_cuda and _dispatch.torch_version() >= (2, 8):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())
