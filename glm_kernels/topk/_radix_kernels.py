"""Radix-select top-k for rows of any length (Triton only; launchers get 2-D row views).

One program walks rows ``pid, pid + P, ...`` (a persistent grid, so scratch is P rows, not
one per input row). For each row, with keys from ``_kernels._order_key`` (always select the
largest):

1. Histogram passes over the row, RADIX_BITS-bit digits from the top, narrow the k-th
   largest key to one bin; ``need`` counts how many entries are still wanted from it.
   Passes stop as soon as that bin holds at most CAND_MAX entries (usually after one).
2. Filter pass: entries above the bin are taken; entries in the bin are copied, as packed
   keys in index order, to a candidate buffer (L2-resident, CAND_MAX entries).
3. The remaining digit passes run over the candidate buffer only; then the candidates above
   the exact threshold T, and the first ``need`` equal to T, are appended.
   Rows whose bin never fits (heavy ties) finish every pass over the row and take the
   classic path instead: one ordered gather over the row.
4. The <= K_POW2 packed keys are sorted in registers (by key, or by index for
   ``sorted=False``) and written out.

Typical rows are read twice from memory (histogram, filter) instead of once per digit plus
once to gather. Positions come from prefix sums over tiles in index order and tie ranks
from running counts, never from atomics: the result is a fixed function of the row.

DIRECT mode (64-bit keys, or k beyond the register sort) skips the candidate buffer and
writes the selected set straight to the outputs in index order; the launcher sorts it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._aot import AotSpec
from .._triton_compat import constexpr_function
from ._kernels import PAD, _fill_like, _order_key, _pack, _topk_desc, _unpack_index
from ._radix_launch import radix_launch, radix_wide_tile


@triton.jit
def _radix_ukey(key, KEY_BITS: tl.constexpr):
    """The key's bits arranged so that unsigned order (digit order) is the key's order."""
    if KEY_BITS == 16:
        return key + 32768                       # int32 in [0, 65535]
    elif KEY_BITS == 32:
        return key ^ -2147483648                 # flip the sign bit of the int32 pattern
    else:
        return key ^ -9223372036854775808


@triton.jit
def _radix_key_of_ukey(ukey, KEY_BITS: tl.constexpr):
    if KEY_BITS == 16:
        return ukey - 32768
    elif KEY_BITS == 32:
        return ukey ^ -2147483648
    else:
        return ukey ^ -9223372036854775808


@constexpr_function
def _digit_shift(key_bits, radix_bits, pass_id):
    """Lowest bit of the digit examined by pass ``pass_id`` (digits go from the top)."""
    return max(key_bits - (pass_id + 1) * radix_bits, 0)


@constexpr_function
def _digit_mask(key_bits, radix_bits, pass_id):
    top = key_bits - pass_id * radix_bits
    return (1 << (top - max(top - radix_bits, 0))) - 1


@constexpr_function
def _num_passes(key_bits, radix_bits):
    return -(-key_bits // radix_bits)


@triton.jit
def _tile_keys(src_ptr, offs, valid, FROM_PACKED: tl.constexpr, IS_FLOAT: tl.constexpr,
               KEY_BITS: tl.constexpr, LARGEST: tl.constexpr):
    """Keys of a tile of the row (raw elements) or of the candidate buffer (packed keys)."""
    if FROM_PACKED:
        return (tl.load(src_ptr + offs, mask=valid) >> 32).to(tl.int32)
    else:
        return _order_key(tl.load(src_ptr + offs, mask=valid), IS_FLOAT, KEY_BITS, LARGEST)


@triton.jit
def _histogram_pass(src_ptr, count, prefix, need, p: tl.constexpr, FROM_PACKED: tl.constexpr,
                    IS_FLOAT: tl.constexpr, KEY_BITS: tl.constexpr, LARGEST: tl.constexpr,
                    RADIX_BITS: tl.constexpr, TILE: tl.constexpr):
    """Digit pass p over ``count`` entries: (prefix, need, entries in the chosen bin).

    Among entries whose higher digits equal ``prefix``'s, the chosen digit d satisfies
    count(digit > d) < need <= count(digit >= d); need drops by count(digit > d).
    """
    BINS: tl.constexpr = 1 << RADIX_BITS
    shift = _digit_shift(KEY_BITS, RADIX_BITS, p)
    top = KEY_BITS - p * RADIX_BITS                      # bits >= top are decided
    bins = tl.arange(0, BINS)
    hist = tl.zeros([BINS], tl.int32)
    for start in range(0, count, TILE):
        offs = start + tl.arange(0, TILE)
        valid = offs < count
        ukey = _radix_ukey(_tile_keys(src_ptr, offs, valid, FROM_PACKED, IS_FLOAT, KEY_BITS,
                                      LARGEST), KEY_BITS)
        if p > 0:
            # Arithmetic shifts of both sides: equal iff the decided bits are equal.
            valid = valid & ((ukey >> top) == (prefix >> top))
        digit = ((ukey >> shift) & _digit_mask(KEY_BITS, RADIX_BITS, p)).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=valid)
    at_or_above = tl.cumsum(hist, 0, reverse=True)
    d = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    need -= tl.sum(tl.where(bins > d, hist, 0), 0)
    in_bin = tl.sum(tl.where(bins == d, hist, 0), 0)
    return prefix | (d.to(prefix.dtype) << shift), need, in_bin


@triton.jit
def _take_above_and_ties(src_ptr, count, threshold, need, dst_ptr, taken, want, values_ptr,
                         indices_ptr, FROM_PACKED: tl.constexpr, DIRECT: tl.constexpr,
                         IS_FLOAT: tl.constexpr, KEY_BITS: tl.constexpr, LARGEST: tl.constexpr,
                         TILE: tl.constexpr):
    """Append, in source (= index) order, every entry with key > threshold and the first
    ``need`` entries with key == threshold; returns the new count, which ends at ``want``
    (the loop stops there).

    Packed keys go to ``dst_ptr[taken:]``; with DIRECT the element and its index go to
    ``values_ptr`` / ``indices_ptr`` instead (row sources only).
    """
    ties_seen = tl.zeros([], tl.int32)
    # A for loop whose tiles past the point where the set is complete do nothing, not a
    # while loop on (start < count) & (taken < want): Triton 3.4's TritonGPUCoalesce pass
    # aborts (an LLVM assertion) on pointers offset by a while loop's carried value.
    for start in range(0, count, TILE):
        if taken < want:
            offs = start + tl.arange(0, TILE)
            valid = offs < count
            if FROM_PACKED:
                packed = tl.load(src_ptr + offs, mask=valid)
                key = (packed >> 32).to(tl.int32)
            else:
                x = tl.load(src_ptr + offs, mask=valid)
                key = _order_key(x, IS_FLOAT, KEY_BITS, LARGEST)
                packed = _pack(key, offs)
            tie = valid & (key == threshold)
            tie_i = tie.to(tl.int32)
            tie_rank = ties_seen + tl.cumsum(tie_i, 0) - tie_i
            chosen = (valid & (key > threshold)) | (tie & (tie_rank < need))
            chosen_i = chosen.to(tl.int32)
            pos = taken + tl.cumsum(chosen_i, 0) - chosen_i
            if DIRECT:
                tl.store(values_ptr + pos, x, mask=chosen)
                tl.store(indices_ptr + pos, offs.to(tl.int64), mask=chosen)
            else:
                tl.store(dst_ptr + pos, packed, mask=chosen)
            ties_seen += tl.sum(tie_i, 0)
            taken += tl.sum(chosen_i, 0)
    return taken


@triton.jit
def _topk_radix_kernel(
    # tensors: x [rows, row_stride]; lengths [rows]; outputs [rows, k];
    #          per-program scratch [P, K_POW2] and candidate buffers [P, CAND_MAX] (int64)
    x_ptr, lengths_ptr, values_ptr, indices_ptr, scratch_ptr, cand_ptr,
    # shapes
    n_rows, n_cols, x_row_stride, k, fill,
    # code paths and tile sizes
    HAS_LENGTHS: tl.constexpr, IS_FLOAT: tl.constexpr, KEY_BITS: tl.constexpr,
    LARGEST: tl.constexpr, DIRECT: tl.constexpr, SORTED: tl.constexpr,
    RADIX_BITS: tl.constexpr, TILE: tl.constexpr, K_POW2: tl.constexpr,
    CAND_MAX: tl.constexpr,
):
    """Top-k of rows of any length by radix select (see the module docstring)."""
    PASSES: tl.constexpr = _num_passes(KEY_BITS, RADIX_BITS)
    pid = tl.program_id(0)
    scratch_row = scratch_ptr + pid.to(tl.int64) * K_POW2
    cand_row = cand_ptr + pid.to(tl.int64) * CAND_MAX
    for row in range(pid, n_rows, tl.num_programs(0)):
        row64 = tl.zeros([], tl.int64) + row
        row_ptr = x_ptr + row64 * x_row_stride
        out_row = row64 * k
        if HAS_LENGTHS:
            n_valid = tl.load(lengths_ptr + row).to(tl.int32)
            n_valid = tl.minimum(tl.maximum(n_valid, 0), n_cols)
        else:
            n_valid = tl.zeros([], tl.int32) + n_cols
        want = tl.minimum(n_valid, k)
        need = want
        in_bin = n_valid
        if KEY_BITS == 64:
            prefix = tl.zeros([], tl.int64)
        else:
            prefix = tl.zeros([], tl.int32)
        # Short rows (n_valid <= k) take everything: threshold = the smallest key.
        passes_done = tl.zeros([], tl.int32) + PASSES
        if n_valid > k:
            passes_done = tl.zeros([], tl.int32)
            for p in tl.static_range(PASSES):
                if in_bin > CAND_MAX:
                    prefix, need, in_bin = _histogram_pass(
                        row_ptr, n_valid, prefix, need, p, False, IS_FLOAT, KEY_BITS, LARGEST,
                        RADIX_BITS, TILE)
                    passes_done = tl.zeros([], tl.int32) + (p + 1)
        threshold = _radix_key_of_ukey(prefix, KEY_BITS)
        none_taken = tl.zeros([], tl.int32)
        if DIRECT:
            taken = _take_above_and_ties(row_ptr, n_valid, threshold, need, scratch_row,
                                         none_taken, want, values_ptr + out_row,
                                         indices_ptr + out_row, False, True, IS_FLOAT,
                                         KEY_BITS, LARGEST, TILE)
            for base in range(taken, k, TILE):           # slots no entry filled
                slots = base + tl.arange(0, TILE)
                fill_value = _fill_like(tl.zeros([TILE], values_ptr.dtype.element_ty), fill,
                                        IS_FLOAT)
                tl.store(values_ptr + out_row + slots, fill_value, mask=slots < k)
                tl.store(indices_ptr + out_row + slots, tl.zeros([TILE], tl.int64) - 1,
                         mask=slots < k)
        else:
            tl.static_assert(KEY_BITS <= 32, "packed keys need keys of at most 32 bits")
            if passes_done == PASSES:
                taken = _take_above_and_ties(row_ptr, n_valid, threshold, need, scratch_row,
                                             none_taken, want, values_ptr, indices_ptr, False,
                                             False, IS_FLOAT, KEY_BITS, LARGEST, TILE)
            else:
                # Filter: keys whose decided top bits beat the threshold's are in; keys that
                # share them are candidates (all of them when no pass ran).
                low_bits = KEY_BITS - passes_done * RADIX_BITS
                low_bits = tl.where(passes_done == 0, KEY_BITS - 1, low_bits)
                threshold_top = threshold >> low_bits
                taken = tl.zeros([], tl.int32)
                in_cands = tl.zeros([], tl.int32)
                for start in range(0, n_valid, TILE):
                    offs = start + tl.arange(0, TILE)
                    valid = offs < n_valid
                    key = _order_key(tl.load(row_ptr + offs, mask=valid), IS_FLOAT, KEY_BITS,
                                     LARGEST)
                    key_top = key >> low_bits
                    # (the interpreter mis-types "tensor & scalar bool": compare tensors)
                    any_pass = tl.zeros([TILE], tl.int32) < passes_done
                    above = valid & (key_top > threshold_top) & any_pass
                    cand = valid & ((key_top == threshold_top) | ~any_pass)
                    above_i = above.to(tl.int32)
                    cand_i = cand.to(tl.int32)
                    packed = _pack(key, offs)
                    tl.store(scratch_row + taken + tl.cumsum(above_i, 0) - above_i, packed,
                             mask=above)
                    tl.store(cand_row + in_cands + tl.cumsum(cand_i, 0) - cand_i, packed,
                             mask=cand)
                    taken += tl.sum(above_i, 0)
                    in_cands += tl.sum(cand_i, 0)
                tl.debug_barrier()      # candidates written above are read by other threads
                for p in tl.static_range(PASSES):
                    if p >= passes_done:
                        prefix, need, in_bin = _histogram_pass(
                            cand_row, in_cands, prefix, need, p, True, IS_FLOAT, KEY_BITS,
                            LARGEST, RADIX_BITS, TILE)
                threshold = _radix_key_of_ukey(prefix, KEY_BITS)
                taken = _take_above_and_ties(cand_row, in_cands, threshold, need, scratch_row,
                                             taken, want, values_ptr, indices_ptr, True, False,
                                             IS_FLOAT, KEY_BITS, LARGEST, TILE)
            # Sort the taken packed keys in registers: by key, or by index (low half).
            slot = tl.arange(0, K_POW2)
            tl.store(scratch_row + slot, tl.zeros([K_POW2], tl.int64) + PAD, mask=slot >= taken)
            tl.debug_barrier()
            best = tl.load(scratch_row + slot)
            if not SORTED:
                best = tl.where(best != PAD, best & 0xFFFFFFFF, PAD)
            best = _topk_desc(best, K_POW2)
            found = best != PAD
            index = tl.where(found, _unpack_index(best), -1)
            keep = slot < k
            value = tl.load(row_ptr + index, mask=keep & found, other=fill)
            tl.store(values_ptr + out_row + slot, value, mask=keep)
            tl.store(indices_ptr + out_row + slot, index, mask=keep)
            tl.debug_barrier()          # the next row reuses this program's scratch


def topk_radix(x2d, lengths, values, indices, scratch, candidates, *, k, fill, is_float,
               key_bits, largest, sorted, direct, radix_bits, tile, num_warps):
    """``scratch`` [P, next_pow2(k)] and ``candidates`` [P, CAND_MAX] int64 set the grid (P
    programs) and the candidate capacity; DIRECT mode takes any (unused) int64 tensors."""
    n_rows, n_cols = x2d.shape
    programs = scratch.shape[0]
    warps, maxnreg = radix_launch(num_warps, direct)
    _topk_radix_kernel[(programs,)](
        x2d, x2d if lengths is None else lengths, values, indices, scratch, candidates,
        n_rows, n_cols, x2d.stride(0), k, fill,
        HAS_LENGTHS=lengths is not None, IS_FLOAT=is_float, KEY_BITS=key_bits,
        LARGEST=largest, DIRECT=direct, SORTED=sorted, RADIX_BITS=radix_bits, TILE=tile,
        K_POW2=1 if direct else scratch.shape[1], CAND_MAX=0 if direct else candidates.shape[1],
        num_warps=warps, maxnreg=maxnreg)


def _radix_aot_specs():
    types = {"fp32": ("*fp32", "fp32", 32), "bf16": ("*bf16", "fp32", 16),
             "i64": ("*i64", "i64", 64)}
    specs = []
    # (dtype, lengths, k_pow2, direct, sorted, tile, warps): the heuristic's DSA launches
    # (many rows: tile 2048 / 8 warps; fewer rows than SMs: tile 4096 / 16 warps) and its
    # direct ones (64-bit keys; 16 warps for k > SORT_IN_KERNEL_MAX or fewer rows than SMs).
    for dtype, lengths, k_pow2, direct, is_sorted, tile, warps in (
            ("fp32", True, 2048, False, True, 2048, 8),
            ("fp32", False, 2048, False, True, radix_wide_tile(False), 16),
            ("fp32", False, 2048, False, False, 2048, 8), ("bf16", True, 2048, False, True, 2048, 8),
            ("i64", False, 1, True, False, 2048, 8),
            ("i64", False, 1, True, False, radix_wide_tile(True), 16),
            ("fp32", True, 1, True, True, 2048, 16)):
        ptr, fill, key_bits = types[dtype]
        signature = {"x_ptr": ptr, "lengths_ptr": "*i32", "values_ptr": ptr,
                     "indices_ptr": "*i64", "scratch_ptr": "*i64", "cand_ptr": "*i64",
                     "n_rows": "i32", "n_cols": "i32", "x_row_stride": "i64", "k": "i32",
                     "fill": fill}
        constexprs = dict(HAS_LENGTHS=lengths, IS_FLOAT=dtype != "i64", KEY_BITS=key_bits,
                          LARGEST=True, DIRECT=direct, SORTED=is_sorted, RADIX_BITS=8,
                          TILE=tile, K_POW2=k_pow2, CAND_MAX=0 if direct else 8192)
        signature.update({name: "constexpr" for name in constexprs})
        mode = f"direct,tile={tile}" if direct else f"k<={k_pow2},sorted={is_sorted},tile={tile}"
        name = f"topk_radix[{dtype},lengths={lengths},{mode}]"
        if any(spec.name == name for spec in specs):
            continue                 # the wide launch is the narrow one on this Triton
        warps, maxnreg = radix_launch(warps, direct)
        specs.append(AotSpec(name, _topk_radix_kernel, signature, constexprs,
                             num_warps=warps, maxnreg=maxnreg))
    return specs


AOT_SPECS = _radix_aot_specs()
