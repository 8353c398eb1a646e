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


def nucleus_csr(batch, targets: List[torch.Tensor], device,
                positions: Optional[List[torch.Tensor]] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(keep_token_ids [K], keep_offsets [N + 1]) int64 on ``device`` for the given response
    rows of every sample in order: ``positions[i]`` (increasing) are the response positions of
    sample i this rank holds (default: all of its ``targets[i].numel()`` positions, CP = 1),
    ``targets[i]`` their tokens."""
    for key in TOPP_KEYS:
        if batch.get(key) is None:
            raise ValueError(f"--rollout-top-p != 1 needs batch[{key!r}] (slime's rollout "
                             f"top-p replay)")
    ids_list, counts_list = [], []
    for i, (ids, offsets, target) in enumerate(zip(batch[TOPP_KEYS[0]], batch[TOPP_KEYS[1]],
                                                   targets)):
        ids, offsets = _as_long(ids), _as_long(offsets)
        pos = torch.arange(target.numel()) if positions is None else \
            positions[i].detach().to("cpu", torch.long)
        size = int(pos.max()) + 1 if pos.numel() else 0
        recorded = max(min(size, offsets.numel() - 1), 0)
        o = offsets[:recorded + 1]
        counts = o.diff()
        if recorded and bool((counts < 0).any()):
            raise ValueError(f"batch['rollout_top_p_token_offsets'][{i}] decreases")
        if recorded and (int(o[0]) < 0 or int(o[-1]) > ids.numel()):
            raise ValueError(f"batch['rollout_top_p_token_offsets'][{i}] points outside "
                             f"batch['rollout_top_p_token_ids'][{i}] ({ids.numel()} ids)")
        kept = ids[int(o[0]):int(o[-1])] if recorded else ids[:0]
        all_counts = torch.cat([counts, counts.new_zeros(size - recorded)])
        if positions is not None and pos.numel() != size:     # this rank's rows only
            held = torch.zeros(size, dtype=torch.bool)
            held[pos] = True
            kept = kept[held[:recorded].repeat_interleave(counts)]
        counts = all_counts[pos]
        recorded_here = pos < recorded
        if bool((recorded_here & (counts == 0)).any()):
            # slime keeps only the target there; {target} reproduces it.
            t = target.detach().to("cpu", torch.long)
            starts = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).tolist()
            parts = [kept[starts[r]:starts[r + 1]] if counts[r] or not recorded_here[r]
                     else t[r:r + 1] for r in range(pos.numel())]
            kept = torch.cat(parts) if parts else kept
            counts = torch.where(recorded_here, counts.clamp(min=1), counts)
        ids_list.append(kept)
        counts_list.append(counts)
    keep_ids = torch.cat(ids_list) if ids_list else torch.zeros(0, dtype=torch.long)
    counts = torch.cat(counts_list) if counts_list else torch.zeros(0, dtype=torch.long)
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    return keep_ids.to(device), offsets.to(device)


def cp_response_positions(args, batch, local_rows: int) -> List[torch.Tensor]:
    """The response positions of every sample that this CP rank's logits hold, in the order of
    slime's ``get_responses``: zigzag, the sample's chunks r and 2 cp - 1 - r
    (``get_logits_and_tokens_offset_with_cp``); ``--allgather-cp``, the rank's contiguous
    slice [rank T_local, (rank + 1) T_local) of the packed stream."""
    from slime.backends.megatron_utils.cp_utils import get_logits_and_tokens_offset_with_cp
    positions, seq_start = [], 0
    if getattr(args, "allgather_cp", False):
        from megatron.core import mpu
        chunk_start = mpu.get_context_parallel_rank() * local_rows
    for total, resp in zip(batch["total_lengths"], batch["response_lengths"]):
        prompt = int(total) - int(resp)
        if getattr(args, "allgather_cp", False):
            first = max(seq_start + prompt - 1, chunk_start)       # logit rows of the response
            last = min(seq_start + int(total) - 1, chunk_start + local_rows)
            base = seq_start + prompt - 1
            positions.append(torch.arange(first - base, max(last, first) - base))
        else:
            _, _, _, tokens = get_logits_and_tokens_offset_with_cp(int(total), int(resp))
            positions.append(torch.cat([torch.arange(a - prompt, b - prompt) for a, b in tokens]))
        seq_start += int(total)
    return positions
