"""Per-token log-probs (and entropy) from logits or from hidden states + the output layer.

``selective_logprobs`` (``logprobs.py``) reads [*S, V] logits once, optionally renormalised
over a top-p nucleus (``_nucleus.py``) or over a Megatron vocab-parallel shard;
``fused_linear_logprobs`` (``linear.py``) never materialises [tokens, V]. Kernels in
``_kernels.py`` / ``_nucleus_kernels.py``, the math in ``_reference.py``, the chunked CPU path
in ``_torch.py``.
"""
from .logprobs import logprobs_rows, selective_logprobs
from .linear import fused_linear_logprobs

__all__ = ["selective_logprobs", "fused_linear_logprobs", "logprobs_rows"]
