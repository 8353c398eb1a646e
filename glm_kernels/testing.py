"""Comparison helpers that say where and by how much two results differ.

Used by the test suite and the benchmarks' correctness checks; users may call them to check
the kernels on their own hardware (``assert_close(out, ref, tol=TOLERANCES[dtype])``).
"""
import torch

# docs/design.md 4: fp32 1e-5, tf32 3e-4, bf16 1e-2; fp16 and fp64 (not listed there) are
# this package's.
TOLERANCES = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2,
              torch.float16: 1e-3, "tf32": 3e-4}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 over finite entries (0 when both are zero)."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    num = (out64 - ref64).norm().item()
    den = ref64.norm().item()
    return num / den if den > 0 else num


def assert_close(out, ref, *, tol, name="result"):
    """Relative-norm check; on failure, report the worst element and its position."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    same_nan = torch.isnan(out.detach().double()) == torch.isnan(ref.detach().double())
    assert bool(same_nan.all()), (f"{name}: NaN positions differ at "
                                  f"{(~same_nan).nonzero()[:5].tolist()}")
    finite = ~torch.isnan(ref.detach().double())
    err = rel_error(out.detach()[finite], ref.detach()[finite])
    if err > tol:
        diff = (out.detach().double() - ref.detach().double()).abs().nan_to_num(0.0)
        worst = int(diff.reshape(-1).argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), out.shape))
        raise AssertionError(
            f"{name}: relative error {err:.3e} > {tol:.1e}; worst at {idx}: "
            f"{out.detach()[idx].item()!r} vs {ref.detach()[idx].item()!r}")


def assert_bits_equal(out: torch.Tensor, ref: torch.Tensor, name="result"):
    """Bit-exact equality (NaN payloads and signed zeros included)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{name}: {tuple(out.shape)}/{out.dtype} vs {tuple(ref.shape)}/{ref.dtype}")
    a = out.contiguous().reshape(-1).view(torch.uint8)   # flat: byte offsets for any rank
    b = ref.contiguous().reshape(-1).view(torch.uint8)
    neq = (a != b).nonzero()
    assert neq.numel() == 0, f"{name}: {neq.shape[0]} bytes differ, first at byte {neq[0].item()}"


def _left_pad(rows, pad_id: int):
    """[len(rows), max_len] ids, left-padded, its attention mask and position ids (0 at each
    row's first real token, as ``generate`` numbers them)."""
    width = max(int(r.numel()) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():] = r
        mask[i, width - r.numel():] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def _sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 log p(token) from logits [..., V] through ``glm_kernels.selective_logprobs``."""
    from .loss import selective_logprobs
    flat = logits.reshape(-1, logits.shape[-1])
    return selective_logprobs(flat, tokens.reshape(-1)).reshape(tokens.shape)


def assert_batch_invariant(model, prompts, *, max_new_tokens: int = 4, pad_token_id: int = 0,
                           batch_size: int = 8, seed: int = 0) -> dict:
    """Check, in the caller's mode, that a rollout's log-probs equal the trainer's to the bit.

    Samples ``max_new_tokens`` tokens for every prompt (a list of 1-D id tensors of different
    lengths, left-padded into one batch) with ``model.generate(do_sample=True,
    output_logits=True)`` and its KV cache, then recomputes each sampled token's log-prob with
    one full forward of every sequence (prompt + sampled tokens) composed three other ways:
    alone; in a batch of ``batch_size`` with filler sequences of other lengths, left-padded;
    the same batch shuffled with one more, longer filler (every row's padding changes). Call
    it inside ``glm_kernels.batch_invariant()`` to check the contract.

    Returns {composition: number of differing log-probs} with ``"rollout"`` the log-probs
    [len(prompts), max_new_tokens]; raises AssertionError naming the first composition,
    sequence and step whose bits differ.
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError("prompts must be a non-empty list of 1-D token-id tensors")
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D tensor of token ids")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or \
            batch_size < len(prompts) + 1:
        raise ValueError(f"batch_size must be an int > len(prompts) = {len(prompts)}, "
                         f"got {batch_size!r}")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ids, mask, _ = _left_pad(list(prompts), pad_token_id)
    with torch.no_grad():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=pad_token_id)
        new = out.sequences[:, ids.shape[1]:].cpu()                     # [B, N]
        rollout = torch.stack([_sampled_logprobs(step, new[:, t].to(step.device))
                               for t, step in enumerate(out.logits)], 1).cpu()
    sequences = [torch.cat([p.cpu(), new[i]]) for i, p in enumerate(prompts)]
    lengths = sorted({int(s.numel()) for s in sequences})
    vocab = model.get_output_embeddings().weight.shape[0]
    filler_lengths = [n for n in range(2, lengths[-1] + 3) if n not in lengths]

    def filler(n):
        return torch.randint(1, vocab, (n,), generator=generator)

    def recompute(rows):
        """{sequence index: log-probs of its sampled tokens} for ``rows``, a list of
        (sequence index or None for a filler, ids), all in one forward."""
        batch_ids, batch_mask, positions = _left_pad([r for _, r in rows], pad_token_id)
        with torch.no_grad():
            logits = model(input_ids=batch_ids.to(device), attention_mask=batch_mask.to(device),
                           position_ids=positions.to(device), use_cache=False).logits
        found = {}
        width = batch_ids.shape[1]
        for row, (index, _) in enumerate(rows):
            if index is None:
                continue
            # The logit that predicts new token t sits one position before it.
            steps = torch.arange(width - max_new_tokens - 1, width - 1)
            found[index] = _sampled_logprobs(logits[row, steps], new[index].to(device)).cpu()
        return found

    fillers = [(None, filler(filler_lengths[j % len(filler_lengths)]))
               for j in range(batch_size - len(sequences))]
    in_batch = list(enumerate(sequences)) + fillers
    order = torch.randperm(len(in_batch) + 1, generator=generator).tolist()
    shuffled_rows = in_batch + [(None, filler(lengths[-1] + 2))]
    alone = {}
    for i, s in enumerate(sequences):
        alone.update(recompute([(i, s)]))
    compositions = {"alone": alone, "batch": recompute(in_batch),
                    "shuffled": recompute([shuffled_rows[i] for i in order])}
    report = {"rollout": rollout}
    for name, found in compositions.items():
        lp = torch.stack([found[i] for i in range(len(sequences))])
        differ = (lp.view(torch.int32) != rollout.view(torch.int32))
        report[name] = int(differ.sum())
        if report[name]:
            seq, step = (int(i) for i in differ.nonzero()[0])
            raise AssertionError(
                f"batch invariance: the full forward ({name}) differs from the rollout in "
                f"{report[name]} of {differ.numel()} log-probs; first: sequence {seq} step "
                f"{step}: {lp[seq, step].item()!r} vs {rollout[seq, step].item()!r}")
    return report


TINY_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "glm_moe_dsa")


def tiny_causal_lm(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A randomly initialised transformers causal LM of ``model_type`` (one of
    ``TINY_MODEL_TYPES``), small enough for CPU tests: hidden 64, 2 layers, vocabulary 96,
    grouped-query heads; MoE models with 4 experts (2 per token); GLM-5 (``glm_moe_dsa``)
    with MLA, its DSA indexer (eager attention: with sdpa the indexer gets no mask) and a
    dense then a sparse layer. No end-of-sequence token (every sample runs its full length);
    pad id 0. Needs ``transformers`` (not a dependency of glm_kernels)."""
    import transformers
    if model_type not in TINY_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r}: expected one of {TINY_MODEL_TYPES}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=128, pad_token_id=0, eos_token_id=None,
                  bos_token_id=None)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if model_type == "llama":
        config = transformers.LlamaConfig(**common, **heads)
    elif model_type == "qwen3":
        config = transformers.Qwen3Config(**common, **heads)
    elif model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, **heads, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=32,
                                             decoder_sparse_step=1)
    else:
        config = transformers.GlmMoeDsaConfig(
            **common, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, index_topk=64,
            index_head_dim=16, index_n_heads=2, mlp_layer_types=["dense", "sparse"],
            attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)
