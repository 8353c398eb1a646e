"""slime's rollout top-p replay (``--rollout-top-p`` < 1) as selective_logprobs' CSR nucleus.

slime 624b824 stores, per sample, the rollout's nucleus of every response token:
``rollout_top_p_token_ids[i]`` (ids) and ``rollout_top_p_token_offsets[i]`` (response token r
keeps ``ids[offsets[r]:offsets[r + 1]]``; tokens past the last recorded one keep the whole
vocabulary). Its loss builds a dense [T, V] bool mask from them with a Python loop per token
(``_build_topp_keep_mask``) and masks a copy of the logits; here the same sets go to
``selective_logprobs`` as one packed id list, O(K) host work and no [T, V] tensor.

slime always keeps the sampled token (it writes the target's logit back after masking), so an
empty recorded nucleus leaves the target alone (log-prob 0): it becomes the one-id nucleus
{target} here (an empty CSR row would mean "no nucleus", the full vocabulary).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

TOPP_KEYS = ("rollout_top_p_token_ids", "rollout_top_p_token_offsets")


def top_p_enabled(args) -> bool:
    return float(getattr(args, "rollout_top_p", 1.0)) != 1.0


def _as_long(x) -> torch.Tensor:
    return x.detach().to("cpu", torch.long).reshape(-1) if torch.is_tensor(x) else \
        torch.tensor(list(x), dtype=torch.long)


def nucleus_csr(batch, targets: List[torch.Tensor], device
                ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(keep_token_ids [K], keep_offsets [N + 1]) int64 on ``device`` for the response rows of
    every sample in order (N = sum of response lengths); ``targets[i]`` are sample i's [R_i]
    response tokens."""
    for key in TOPP_KEYS:
        if batch.get(key) is None:
            raise ValueError(f"--rollout-top-p != 1 needs batch[{key!r}] (slime's rollout "
                             f"top-p replay)")
    ids_list, counts_list = [], []
    for i, (ids, offsets, target) in enumerate(zip(batch[TOPP_KEYS[0]], batch[TOPP_KEYS[1]],
                                                   targets)):
        ids, offsets = _as_long(ids), _as_long(offsets)
        size = int(target.numel())
        recorded = max(min(size, offsets.numel() - 1), 0)
        o = offsets[:recorded + 1]
        counts = o.diff()
        if recorded and bool((counts < 0).any()):
            raise ValueError(f"batch['rollout_top_p_token_offsets'][{i}] decreases")
        if recorded and (int(o[0]) < 0 or int(o[-1]) > ids.numel()):
            raise ValueError(f"batch['rollout_top_p_token_offsets'][{i}] points outside "
                             f"batch['rollout_top_p_token_ids'][{i}] ({ids.numel()} ids)")
        kept = ids[int(o[0]):int(o[-1])] if recorded else ids[:0]
        if recorded and bool((counts == 0).any()):
            # slime keeps only the target there; {target} reproduces it.
            t = target.detach().to("cpu", torch.long)
            parts = [kept[int(a) - int(o[0]):int(b) - int(o[0])] if b > a else t[r:r + 1]
                     for r, (a, b) in enumerate(zip(o[:-1].tolist(), o[1:].tolist()))]
            kept, counts = torch.cat(parts), counts.clamp(min=1)
        ids_list.append(kept)
        counts_list.append(torch.cat([counts, counts.new_zeros(size - recorded)]))
    keep_ids = torch.cat(ids_list) if ids_list else torch.zeros(0, dtype=torch.long)
    counts = torch.cat(counts_list) if counts_list else torch.zeros(0, dtype=torch.long)
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    return keep_ids.to(device), offsets.to(device)
