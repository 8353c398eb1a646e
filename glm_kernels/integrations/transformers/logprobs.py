"""``token_logprobs``: per-token log-probs (and entropy) of a transformers causal LM through
``fused_linear_logprobs``: the model's last hidden states and its ``lm_head`` go into the
chunked fused pass, so no [tokens, V] fp32 logits tensor is ever built."""
from typing import Optional

import torch

from ... import _checks
from ...loss import fused_linear_logprobs


def _body_and_head(model: torch.nn.Module):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if not isinstance(head, torch.nn.Linear) or body is None or body is model:
        raise TypeError(f"model must be a transformers *ForCausalLM (a base model under "
                        f"model.{getattr(model, 'base_model_prefix', 'model')} and a Linear "
                        f"lm_head), got {type(model).__name__}")
    if head.bias is not None:
        raise ValueError(f"{type(model).__name__}'s lm_head has a bias; token_logprobs "
                         "supports bias-free output layers (every model glm_kernels patches)")
    return body, head


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: Optional[torch.Tensor] = None, *,
                   temperature: float = 1.0, return_entropy: bool = False, **model_kwargs):
    """Log-probs of ``input_ids[:, 1:]`` under ``model``, without [tokens, V] fp32 logits.

    Parameters
    ----------
    model : a transformers ``*ForCausalLM`` (patched by ``apply_glm_kernels`` or not)
    input_ids : Tensor [B, S] int64
    attention_mask : Tensor [B, S], optional (passed to the model)
    temperature : float > 0, default 1.0
    return_entropy : bool, default False
    **model_kwargs : passed to the base model's forward (e.g. ``position_ids``).

    Returns
    -------
    Tensor [B, S - 1] fp32: ``log_softmax(model(input_ids).logits / temperature)[:, :-1]``
    gathered at ``input_ids[:, 1:]``; with ``return_entropy`` also the entropy [B, S - 1]
    fp32 of the same distributions. Differentiable: gradients reach every parameter.
    """
    body, head = _body_and_head(model)
    _checks.check_tensor("input_ids", input_ids, dtypes=(torch.int64, torch.int32), ndim=(2,))
    return_entropy = _checks.check_bool("return_entropy", return_entropy)
    temperature = _checks.check_finite_number("temperature", temperature, positive=True)
    if input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must hold at least 2 tokens per row (log-probs are of "
                         f"tokens 1..S-1), got shape {tuple(input_ids.shape)}")
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                  **model_kwargs).last_hidden_state
    hidden = hidden[:, :-1]
    weight = head.weight
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return fused_linear_logprobs(hidden, weight, input_ids[:, 1:], temperature=temperature,
                                 return_entropy=return_entropy)
