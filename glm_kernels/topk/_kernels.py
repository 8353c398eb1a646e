"""Triton kernels of the top-k package. No validation here: launchers get 2-D row views.

Every kernel ranks elements by an order-preserving signed integer key (``_order_key``) whose
order is ``torch.sort``'s: NaN above +inf (all NaNs equal), -0.0 equal to +0.0; for
``largest=False`` the key is complemented, so every kernel always selects the LARGEST keys.
Ties go to the smaller index because, for keys of at most 32 bits, the index is packed into
the low half of a 64-bit key as ``0xFFFFFFFF - index``: all packed keys of a row differ, so
any correct sorting network gives one answer. Empty slots carry ``PAD`` (below every real
packed key, since a real one has a nonzero low half).

* ``_topk_short_kernel``: a few rows per program, each row in registers, bitonic top-k of
  the packed keys.
* ``_moe_route_kernel``: DeepSeek-V3 ``noaux_tc`` routing for a few tokens per program, or
  rollout routing replay (recorded ids in, their weights and the mismatch flag out).

The radix-select kernel for long rows lives in ``_radix_kernels.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._aot import AotSpec
from .._dispatch import triton_version
from .._triton_compat import constexpr_function

PAD = tl.constexpr(-(2 ** 63))     # packed key of an empty slot


@triton.jit
def _order_key(x, IS_FLOAT: tl.constexpr, KEY_BITS: tl.constexpr, LARGEST: tl.constexpr):
    """Signed integer key (int32 for <= 32-bit inputs, int64 otherwise) in torch.sort order.

    Floats: non-negative bit patterns already order like their values; negative ones order
    backwards, so their 15 (31, 63) value bits are flipped. -0.0 maps to +0.0's key and every
    NaN to the largest key. ``LARGEST=False`` complements the key (reverses the order).
    NaN and zero are recognised from the bits (the interpreter compares bf16 as integers).
    """
    if IS_FLOAT:
        if KEY_BITS == 16:
            bits = x.to(tl.int16, bitcast=True).to(tl.int32)
            magnitude_mask: tl.constexpr = 0x7FFF
            inf_bits: tl.constexpr = 0x7F80 if x.dtype.is_bf16() else 0x7C00
        elif KEY_BITS == 32:
            bits = x.to(tl.int32, bitcast=True)
            magnitude_mask: tl.constexpr = 0x7FFFFFFF
            inf_bits: tl.constexpr = 0x7F800000
        else:
            bits = x.to(tl.int64, bitcast=True)
            magnitude_mask: tl.constexpr = 0x7FFFFFFFFFFFFFFF
            inf_bits: tl.constexpr = 0x7FF0000000000000
        magnitude = bits & magnitude_mask
        key = tl.where(bits < 0, bits ^ magnitude_mask, bits)
        key = tl.where(magnitude > inf_bits, magnitude_mask, key)     # every NaN
        key = tl.where(magnitude == 0, 0, key)                         # -0.0 == +0.0
    else:
        key = x
    if not LARGEST:
        key = ~key
    return key


@triton.jit
def _pack(key, index):
    """(key << 32) | (0xFFFFFFFF - index): larger key first, then smaller index first."""
    return (key.to(tl.int64) << 32) | (0xFFFFFFFF - index.to(tl.int64))


@triton.jit
def _unpack_index(packed):
    return 0xFFFFFFFF - (packed & 0xFFFFFFFF)


# --------------------------------------------------------------------------- bitonic network
# Triton's tl.topk swaps partners with an xor-reduction, which its interpreter runs one
# element at a time in Python; this network takes max/min over each pair instead (one
# shuffle each on the GPU, vectorised numpy in the interpreter) and is otherwise the same
# algorithm (Shanbhag et al., "Efficient Top-K Query Processing on Massively Parallel
# Hardware"): sort blocks of K, then repeatedly keep the larger half of each pair of blocks.
@constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.jit
def _pair_position(n_dims: tl.constexpr, j: tl.constexpr):
    """0/1 along hypercube axis j (counted from the innermost), size 1 elsewhere."""
    return tl.reshape(tl.arange(0, 2), [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_swap(h, descending, j: tl.constexpr):
    """One compare-exchange round on hypercube axis j: each pair ends ascending, or
    descending where ``descending`` (0/1, broadcastable) is 1."""
    n_dims: tl.constexpr = _log2(h.numel)
    larger = tl.max(h, axis=n_dims - 1 - j, keep_dims=True)
    smaller = tl.min(h, axis=n_dims - 1 - j, keep_dims=True)
    takes_larger = (descending ^ _pair_position(n_dims, j)) != 0
    return tl.where(takes_larger, larger, smaller)


@triton.jit
def _bitonic_merge(h, stage: tl.constexpr, order: tl.constexpr):
    """Merge bitonic runs of 2**stage; order 0 ascending, 1 descending, 2 alternating."""
    if order == 2:
        descending = _pair_position(_log2(h.numel), stage)
    else:
        descending = order
    for i in tl.static_range(stage):
        h = _compare_swap(h, descending, stage - 1 - i)
    return h


@triton.jit
def _topk_desc(x, K: tl.constexpr):
    """The K largest along the last dim (power of two sizes), sorted descending."""
    N: tl.constexpr = x.shape[len(x.shape) - 1]
    log_n: tl.constexpr = _log2(N)
    log_k: tl.constexpr = _log2(K)
    if log_k == 0:
        out = tl.max(x, axis=len(x.shape) - 1, keep_dims=True)
    else:
        h = tl.reshape(x, [2] * _log2(x.numel))
        for i in tl.static_range(1, log_k + 1):
            h = _bitonic_merge(h, i, 2 if i < log_n else 1)
        for i in tl.static_range(log_k + 1, log_n + 1):
            h = tl.max(h, axis=_log2(h.numel) - 1 - log_k)
            h = _bitonic_merge(h, log_k, 2 if i < log_n else 1)
        out = tl.reshape(h, x.shape[:-1] + [K])
    return out


# --------------------------------------------------------------------------- short rows
@triton.jit
def _fill_like(zeros, fill, IS_FLOAT: tl.constexpr):
    """``fill`` in the dtype of the zero tile ``zeros``. Floats go through fp32 (the fill is
    +-inf, exact in every float type) because Triton 3.6's interpreter has no bf16 scalar
    constants; the compiled code folds either form to one constant."""
    if IS_FLOAT:
        return (zeros.to(tl.float32) + fill).to(zeros.dtype)
    else:
        return zeros + fill


@triton.jit
def _topk_short_kernel(
    # tensors: x [rows, row_stride], lengths [rows] (int32/int64), outputs [rows, k]
    x_ptr, lengths_ptr, values_ptr, indices_ptr,
    # shapes
    n_rows, n_cols, x_row_stride, k, fill,
    # code paths and tile sizes
    HAS_LENGTHS: tl.constexpr, IS_FLOAT: tl.constexpr, KEY_BITS: tl.constexpr,
    LARGEST: tl.constexpr, SORTED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    K_POW2: tl.constexpr,
):
    """Top-k of ROWS rows of at most BLOCK entries, all in registers (keys <= 32 bits)."""
    tl.static_assert(KEY_BITS <= 32, "the short-row kernel packs the index into the key")
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK)
    if HAS_LENGTHS:
        n_valid = tl.load(lengths_ptr + rows, mask=row_ok, other=0).to(tl.int32)
        n_valid = tl.minimum(tl.maximum(n_valid, 0), n_cols)
    else:
        n_valid = tl.zeros([ROWS], tl.int32) + n_cols
    valid = row_ok[:, None] & (cols[None, :] < n_valid[:, None])
    row_ptr = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    x = tl.load(row_ptr + cols[None, :], mask=valid)
    packed = tl.where(valid, _pack(_order_key(x, IS_FLOAT, KEY_BITS, LARGEST), cols[None, :]),
                      PAD)
    best = _topk_desc(packed, K_POW2)                                # [ROWS, K_POW2], descending
    slot = tl.arange(0, K_POW2)[None, :]
    out_offs = rows.to(tl.int64)[:, None] * k + slot
    if SORTED:
        found = best != PAD
        index = tl.where(found, _unpack_index(best), -1)
        keep = row_ok[:, None] & (slot < k)
        value = tl.load(row_ptr + index, mask=keep & found, other=fill)   # the element's bits
        tl.store(values_ptr + out_offs, value, mask=keep)
        tl.store(indices_ptr + out_offs, index, mask=keep)
    else:
        # Threshold = the k-th largest packed key; the selected set, written in index order.
        kth = tl.sum(tl.where(slot == k - 1, best, 0), axis=1)
        chosen = valid & (packed >= kth[:, None])
        chosen_i = chosen.to(tl.int32)
        pos = tl.cumsum(chosen_i, axis=1) - 1
        dst = rows.to(tl.int64)[:, None] * k + pos
        tl.store(values_ptr + dst, x, mask=chosen)
        tl.store(indices_ptr + dst, cols[None, :].to(tl.int64), mask=chosen)
        count = tl.sum(chosen_i, axis=1)
        empty = row_ok[:, None] & (slot >= count[:, None]) & (slot < k)
        fill_value = _fill_like(tl.zeros([ROWS, K_POW2], values_ptr.dtype.element_ty), fill,
                                IS_FLOAT)
        tl.store(values_ptr + out_offs, fill_value, mask=empty)
        tl.store(indices_ptr + out_offs, tl.zeros([ROWS, K_POW2], tl.int64) - 1, mask=empty)


# --------------------------------------------------------------------------- MoE routing
@triton.jit
def _noaux_tc_topk(scores, valid, experts, bias_ptr, n_experts, topk_group, group_size,
                   HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, K_POW2: tl.constexpr,
                   EXACT_BLOCK: tl.constexpr):
    """Packed keys of each row's K_POW2 best eligible experts, descending (PAD past the end).

    c = s + bias; group score = sum of the two largest c in the group; keep the topk_group
    best groups; rank c over kept experts. Packed keys: ties go to the lower group / expert.
    """
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + experts, mask=experts < n_experts, other=0.0)
    packed = tl.where(valid, _pack(_order_key(choice, True, 32, True), experts), PAD)

    if N_GROUP > 1:
        GROUP_VIEW: tl.constexpr = EXACT_BLOCK and BLOCK_G == N_GROUP
        groups = tl.arange(0, BLOCK_G)[None, :]
        if GROUP_VIEW:
            # Power-of-two experts and groups: one [ROWS, groups, group_size] view.
            by_group = tl.reshape(packed, [ROWS, N_GROUP, BLOCK_E // N_GROUP])
            choice_by_group = tl.reshape(choice, [ROWS, N_GROUP, BLOCK_E // N_GROUP])
            first = tl.max(by_group, axis=2)
            is_first = by_group == first[:, :, None]
            second = tl.max(tl.where(is_first, PAD, by_group), axis=2)
            is_second = (by_group == second[:, :, None]) & (by_group != PAD)
            top2 = (tl.sum(tl.where(is_first, choice_by_group, 0.0), axis=2)
                    + tl.sum(tl.where(is_second, choice_by_group, 0.0), axis=2))
            group_packed = _pack(_order_key(top2, True, 32, True), groups)
        else:
            group_of = experts // group_size
            group_packed = tl.zeros([ROWS, BLOCK_G], tl.int64) + PAD
            for g in tl.static_range(N_GROUP):
                in_group = valid & (group_of == g)
                first = tl.max(tl.where(in_group, packed, PAD), axis=1)
                is_first = in_group & (packed == first[:, None])
                second = tl.max(tl.where(in_group & ~is_first, packed, PAD), axis=1)
                is_second = in_group & (packed == second[:, None])
                top2 = (tl.sum(tl.where(is_first, choice, 0.0), axis=1)
                        + tl.sum(tl.where(is_second, choice, 0.0), axis=1))
                key = _pack(_order_key(top2, True, 32, True), tl.zeros([ROWS], tl.int32) + g)
                group_packed = tl.where(groups == g, key[:, None], group_packed)
        # Rank of each group among the row's groups (packed keys are distinct).
        better = (group_packed[:, None, :] > group_packed[:, :, None]).to(tl.int32)
        kept_group = ((tl.sum(better, axis=2) < topk_group) & (groups < N_GROUP)).to(tl.int32)
        if GROUP_VIEW:
            expert_kept = tl.reshape(tl.broadcast_to(kept_group[:, :, None],
                                                     [ROWS, N_GROUP, BLOCK_E // N_GROUP]),
                                     [ROWS, BLOCK_E])
        else:
            expert_kept = tl.zeros([ROWS, BLOCK_E], tl.int32)
            for g in tl.static_range(N_GROUP):
                kept_g = tl.sum(tl.where(groups == g, kept_group, 0), axis=1)
                expert_kept = tl.where(group_of == g, kept_g[:, None], expert_kept)
        packed = tl.where(expert_kept != 0, packed, PAD)
    return _topk_desc(packed, K_POW2)


@triton.jit
def _moe_route_kernel(
    # tensors: logits [tokens, logits_row_stride], bias [experts] fp32, replay ids [tokens, k]
    # (any integer dtype), outputs weights / ids [tokens, k], mismatch [tokens] uint8
    logits_ptr, bias_ptr, replay_ptr, weights_ptr, ids_ptr, mismatch_ptr,
    # shapes and runtime scalars
    n_tokens, n_experts, logits_row_stride, k, topk_group, group_size, scaling_factor, eps,
    # code paths and tile sizes
    HAS_BIAS: tl.constexpr, SCORING: tl.constexpr, RENORMALIZE: tl.constexpr,
    REPLAY: tl.constexpr, MISMATCH: tl.constexpr,
    N_GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
    K_POW2: tl.constexpr, EXACT_BLOCK: tl.constexpr,
):
    """noaux_tc routing of ROWS tokens: scores, biased choice, group limit, top-k, weights.

    s = sigmoid(l), softmax(l) or sqrt(softplus(l)) (SCORING 0, 1, 2); ids = the noaux_tc
    choice (``_noaux_tc_topk``), or with
    REPLAY the recorded ids read from ``replay_ptr`` (the choice is skipped unless MISMATCH
    asks whether it would differ: mismatch[t] = 1 where the two expert sets differ);
    weights = s[ids] (/ (sum + eps) when renormalizing) * scaling_factor, the same
    expression on both paths, so equal ids in equal order give bitwise equal weights.
    """
    tl.static_assert(REPLAY or not MISMATCH, "the mismatch compares against replayed ids")
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_tokens
    experts = tl.arange(0, BLOCK_E)[None, :]
    valid = row_ok[:, None] & (experts < n_experts)
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * logits_row_stride + experts,
                     mask=valid, other=0.0).to(tl.float32)
    if SCORING == 1:
        shifted = tl.where(valid, logits, -float("inf"))
        row_max = tl.max(shifted, axis=1)
        row_max = tl.where(row_ok, row_max, 0.0)
        expo = tl.where(valid, tl.exp(shifted - row_max[:, None]), 0.0)
        total = tl.where(row_ok, tl.sum(expo, axis=1), 1.0)      # padding rows: no 0/0
        scores = expo / total[:, None]
    elif SCORING == 2:
        # sqrt(max(l, 0) + log1p(exp(-|l|))), log1p(e) = log(u) * e / (u - 1), u = 1 + e
        e = tl.exp(-tl.abs(logits))
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0))
        scores = tl.sqrt(tl.maximum(logits, 0.0) + log1p)
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))

    slot = tl.arange(0, K_POW2)[None, :]
    out = rows.to(tl.int64)[:, None] * k + slot
    store = row_ok[:, None] & (slot < k)
    if REPLAY:
        keep = store
        index = tl.load(replay_ptr + out, mask=keep, other=0).to(tl.int64)
        if MISMATCH:
            best = _noaux_tc_topk(scores, valid, experts, bias_ptr, n_experts, topk_group,
                                  group_size, HAS_BIAS, N_GROUP, ROWS, BLOCK_E, BLOCK_G,
                                  K_POW2, EXACT_BLOCK)
            own = tl.where((slot < k) & (best != PAD), _unpack_index(best), -1)
            # Replayed ids are distinct and own ids are distinct: the sets are equal iff
            # every replayed id is found among the own ids.
            found = tl.sum((index[:, :, None] == own[:, None, :]).to(tl.int32), axis=2)
            n_found = tl.sum(tl.where(keep, found, 0), axis=1)
            tl.store(mismatch_ptr + rows, (n_found < k).to(tl.uint8), mask=row_ok)
    else:
        best = _noaux_tc_topk(scores, valid, experts, bias_ptr, n_experts, topk_group,
                              group_size, HAS_BIAS, N_GROUP, ROWS, BLOCK_E, BLOCK_G, K_POW2,
                              EXACT_BLOCK)
        keep = (slot < k) & (best != PAD)
        index = tl.where(keep, _unpack_index(best), 0)
    weights = tl.where(keep, tl.gather(scores, index.to(tl.int32), axis=1), 0.0)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + eps)
    weights = weights * scaling_factor
    tl.store(weights_ptr + out, weights, mask=store)
    tl.store(ids_ptr + out, tl.where(keep, index, -1), mask=store)


# --------------------------------------------------------------------------- launchers
def topk_short(x2d, lengths, values, indices, *, k, fill, is_float, key_bits, largest,
               sorted, rows_per_program, block, num_warps):
    n_rows, n_cols = x2d.shape
    grid = (triton.cdiv(n_rows, rows_per_program),)
    _topk_short_kernel[grid](
        x2d, x2d if lengths is None else lengths, values, indices,
        n_rows, n_cols, x2d.stride(0), k, fill,
        HAS_LENGTHS=lengths is not None, IS_FLOAT=is_float, KEY_BITS=key_bits,
        LARGEST=largest, SORTED=sorted, ROWS=rows_per_program, BLOCK=block,
        K_POW2=triton.next_power_of_2(k), num_warps=num_warps)


# Triton < 3.6's sm_90 code for replay with the mismatch check, sizes divisible by 16, settles
# on 128 registers and spills 8 B to the stack (3.6, 3.9: no spill); capped at 168 it takes
# 142 (168 without the divisibility) and spills nothing; 4 warps x 168 fit the register file.
_TRITON_3_4_MISMATCH_MAXNREG = 168


def moe_route_maxnreg(mismatch: bool):
    """The register cap a moe_route launch passes (None: ptxas's choice)."""
    return _TRITON_3_4_MISMATCH_MAXNREG if mismatch and triton_version() < (3, 6) else None


def moe_route(logits2d, bias, replay_ids, weights, ids, mismatch, *, k, scoring, n_group,
              topk_group, renormalize, scaling_factor, eps, rows_per_program, num_warps):
    """replay_ids: [tokens, k] contiguous, or None; mismatch: uint8 [tokens] (written only
    when replaying), or None."""
    n_tokens, n_experts = logits2d.shape
    grid = (triton.cdiv(n_tokens, rows_per_program),)
    _moe_route_kernel[grid](
        logits2d, logits2d if bias is None else bias,
        ids if replay_ids is None else replay_ids, weights, ids,
        ids if mismatch is None else mismatch,
        n_tokens, n_experts, logits2d.stride(0), k, topk_group, n_experts // n_group,
        scaling_factor, eps,
        HAS_BIAS=bias is not None, SCORING=scoring, RENORMALIZE=renormalize,
        REPLAY=replay_ids is not None, MISMATCH=mismatch is not None,
        N_GROUP=n_group, ROWS=rows_per_program, BLOCK_E=triton.next_power_of_2(n_experts),
        BLOCK_G=triton.next_power_of_2(n_group), K_POW2=triton.next_power_of_2(k),
        EXACT_BLOCK=n_experts == triton.next_power_of_2(n_experts), num_warps=num_warps,
        maxnreg=moe_route_maxnreg(mismatch is not None))


# --------------------------------------------------------------------------- AOT specs
_TYPES = {"fp32": ("*fp32", "fp32"), "bf16": ("*bf16", "fp32"), "i64": ("*i64", "i64")}


def _with_constexprs(signature, constexprs):
    return dict(signature, **{name: "constexpr" for name in constexprs})


def _topk_aot_specs():
    specs = []
    for dtype, rows, block, k_pow2, is_sorted, warps in (
            ("fp32", 8, 256, 8, True, 4), ("bf16", 8, 256, 8, True, 4),
            ("fp32", 1, 4096, 2048, True, 8), ("fp32", 1, 4096, 2048, False, 8)):
        ptr, fill = _TYPES[dtype]
        signature = {"x_ptr": ptr, "lengths_ptr": "*i32", "values_ptr": ptr,
                     "indices_ptr": "*i64", "n_rows": "i32", "n_cols": "i32",
                     "x_row_stride": "i64", "k": "i32", "fill": fill}
        constexprs = dict(HAS_LENGTHS=False, IS_FLOAT=True, KEY_BITS=16 if dtype == "bf16" else 32,
                          LARGEST=True, SORTED=is_sorted, ROWS=rows, BLOCK=block, K_POW2=k_pow2)
        specs.append(AotSpec(f"topk_short[{dtype},{rows}x{block},k<={k_pow2},"
                             f"sorted={is_sorted}]", _topk_short_kernel,
                             _with_constexprs(signature, constexprs), constexprs,
                             num_warps=warps))
    signature = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "replay_ptr": "*i64",
                 "weights_ptr": "*fp32", "ids_ptr": "*i64", "mismatch_ptr": "*u8",
                 "n_tokens": "i32", "n_experts": "i32",
                 "logits_row_stride": "i64", "k": "i32", "topk_group": "i32",
                 "group_size": "i32", "scaling_factor": "fp32", "eps": "fp32"}
    # (scoring, n_group, replay, mismatch): routing, and rollout routing replay with and
    # without the mismatch check (GLM-5 shape).
    for scoring, n_group, replay, mismatch in ((0, 8, False, False),
                                               (1, 1, False, False),
                                               (2, 1, False, False),
                                               (0, 8, True, True),
                                               (0, 8, True, False)):
        constexprs = dict(HAS_BIAS=True, SCORING=scoring, RENORMALIZE=True, REPLAY=replay,
                          MISMATCH=mismatch, N_GROUP=n_group, ROWS=8, BLOCK_E=256,
                          BLOCK_G=n_group, K_POW2=8, EXACT_BLOCK=True)
        mode = (",replay+mismatch" if mismatch else ",replay") if replay else ""
        specs.append(AotSpec(f"moe_route[256 experts,{n_group} groups,"
                             f"{('sigmoid', 'softmax', 'sqrtsoftplus')[scoring]},8 tokens{mode}]",
                             _moe_route_kernel, _with_constexprs(signature, constexprs),
                             constexprs, num_warps=4, maxnreg=moe_route_maxnreg(mismatch)))
    return specs


AOT_SPECS = _topk_aot_specs()
