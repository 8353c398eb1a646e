"""Plain-PyTorch definition of the log-probs: the oracle the kernels are tested against.

With z = logits / T, p = softmax(z), lse = logsumexp(z)::

    lp = z[t] - lse              d lp / dz = onehot(t) - p
    H  = -sum_v p_v log p_v      d H / dz  = -p (log p + H)      (-inf entries contribute 0)

The definition and the torch backend's shard-aware closed forms live in
``loss/_common/softmax.py``: IcePop from logits, the reverse KL and the vocab-parallel combine
share them. The top-p nucleus variant's definition is ``_nucleus.reference``.
"""
from .._common.softmax import selective_logprobs_reference

__all__ = ["selective_logprobs_reference"]
