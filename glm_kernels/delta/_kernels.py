"""Triton kernels of the delta codec. No validation here: callers pass flat signed-integer
views (int8/16/32/64) of contiguous tensors and outputs of the right size.

Encode is two passes over the tensors' elements with a scan of per-program totals between
them (done by torch on the tiny [programs] arrays):
  1. ``_encode_scan_kernel`` reads new and old once: a 1-bit-per-element change mask, and per
     program the change count, first/last changed position and checksum sums.
  2. ``_encode_write_kernel`` reads the mask (1/8 byte per element) and, only at changed
     positions, new (and old for differences): writes positions or gap16 gaps, and values.
Apply decodes gaps with a scan in two passes (``_gap_sums_kernel``, ``_gap_positions_kernel``),
checksums the target (``_checksum_kernel``), sums the checksum change of the changed
elements (``_apply_values_kernel`` with WRITE=False), and only after the host has compared
both with the packet scatters the values (the same kernel with WRITE=True).
Offsets are int64 throughout: tensors past 2^31 elements are addressed correctly.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._aot import AotSpec
from . import _reference as ref

_K1, _K2, _K3 = tl.constexpr(ref.K1), tl.constexpr(ref.K2), tl.constexpr(ref.K3)
_M1, _M2, _M3 = tl.constexpr(ref.M1), tl.constexpr(ref.M2), tl.constexpr(ref.M3)
_ESCAPE = tl.constexpr(ref.ESCAPE)
VERIFY_CHUNK = 256   # changes per step of the verify kernel's loop
STATS = 8   # per-program encode stats: count, first, last, S(new) lo/hi, S(old) lo/hi, unused


@triton.jit
def _word_terms(w, lo, hi):
    """Checksum terms (uint64) of 32-bit words ``w`` at word index hi:lo (uint32 halves; ``hi``
    may be a scalar): (w ^ k) * m with k, m from the index (see _reference)."""
    k = lo * _K1 + (hi * _K2 + _K3)
    m = (lo * _M1 + (hi * _M2 + _M3)) | 1
    return (w ^ k).to(tl.uint64) * m.to(tl.uint64)


@triton.jit
def _element_terms(x, lo, hi, SIZE: tl.constexpr):
    """Checksum terms of elements ``x`` (signed view of SIZE bytes) whose first word index is
    hi:lo; an 8-byte element has two words, lo (even) and lo + 1."""
    if SIZE == 8:
        u = x.to(tl.uint64, bitcast=True)
        terms = _word_terms((u & 0xFFFFFFFF).to(tl.uint32), lo, hi) + \
            _word_terms((u >> 32).to(tl.uint32), lo + 1, hi)
    elif SIZE == 4:
        terms = _word_terms(x.to(tl.uint32, bitcast=True), lo, hi)
    elif SIZE == 2:
        terms = _word_terms(x.to(tl.uint16, bitcast=True).to(tl.uint32), lo, hi)
    else:
        terms = _word_terms(x.to(tl.uint8, bitcast=True).to(tl.uint32), lo, hi)
    return terms


@triton.jit
def _block_word_index(start, local, SIZE: tl.constexpr):
    """Word index halves of elements start + local, ``start`` a multiple of a power-of-two
    block: lo = low half of start's word index + local's (no carry), hi a scalar."""
    words_per = 2 if SIZE == 8 else 1
    first = start * words_per
    return first.to(tl.uint32) + (local * words_per).to(tl.uint32), (first >> 32).to(tl.uint32)


@triton.jit
def _gathered_word_index(pos, SIZE: tl.constexpr):
    """Word index halves (vectors) of arbitrary int64 element positions."""
    first = pos * 2 if SIZE == 8 else pos
    return first.to(tl.uint32), (first >> 32).to(tl.uint32)


@triton.jit
def _store_sum(ptr, s):
    """A uint64 sum as two int64 halves below 2^32, so torch adds rows without overflow."""
    tl.store(ptr, (s & 0xFFFFFFFF).to(tl.int64))
    tl.store(ptr + 1, (s >> 32).to(tl.int64))


@triton.jit
def _checksum_kernel(x_ptr, partial_ptr, n, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """partial[pid] = sum over this program's elements of their checksum terms (mod 2^64)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK          # 64-bit scalar base; 32-bit lane offsets
    local = tl.arange(0, BLOCK)
    in_bounds = local < tl.minimum(n - start, BLOCK).to(tl.int32)
    x = tl.load(x_ptr + start + local, mask=in_bounds, other=0)
    lo, hi = _block_word_index(start, local, SIZE)
    terms = tl.where(in_bounds, _element_terms(x, lo, hi, SIZE), 0)
    _store_sum(partial_ptr + pid.to(tl.int64) * 2, tl.sum(terms, axis=0))


@triton.jit
def _encode_scan_kernel(new_ptr, old_ptr, mask_ptr, stats_ptr, n, HASH_OLD: tl.constexpr,
                        SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1: change mask (bit j of word w = element 32w + j changed) and per-program stats."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    local = tl.arange(0, BLOCK)
    in_bounds = local < tl.minimum(n - start, BLOCK).to(tl.int32)
    x = tl.load(new_ptr + start + local, mask=in_bounds, other=0)
    y = tl.load(old_ptr + start + local, mask=in_bounds, other=0)
    changed = (x != y) & in_bounds
    flags = tl.reshape(changed.to(tl.uint32), (BLOCK // 32, 32))
    words = tl.sum(flags << tl.arange(0, 32).to(tl.uint32)[None, :], axis=1)
    tl.store(mask_ptr + pid.to(tl.int64) * (BLOCK // 32) + tl.arange(0, BLOCK // 32),
             words.to(tl.int32, bitcast=True))
    n_changed = tl.sum(changed.to(tl.int32), axis=0)
    row = stats_ptr + pid.to(tl.int64) * 8
    tl.store(row, n_changed.to(tl.int64))
    tl.store(row + 1, start + tl.min(tl.where(changed, local, BLOCK), axis=0))
    tl.store(row + 2, tl.where(n_changed > 0,
                               start + tl.max(tl.where(changed, local, 0), axis=0), -1))
    lo, hi = _block_word_index(start, local, SIZE)
    _store_sum(row + 3, tl.sum(tl.where(in_bounds, _element_terms(x, lo, hi, SIZE), 0), axis=0))
    if HASH_OLD:
        _store_sum(row + 5, tl.sum(tl.where(in_bounds, _element_terms(y, lo, hi, SIZE), 0),
                                   axis=0))


@triton.jit
def _encode_write_kernel(new_ptr, old_ptr, mask_ptr, offset_ptr, prev_last_ptr, pos_ptr, val_ptr,
                         count, GAP16: tl.constexpr, DIFF: tl.constexpr, PLANAR: tl.constexpr,
                         SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 2: the k-th change of the tensor goes to slot k (offset of this program + rank)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    local = tl.arange(0, BLOCK)
    lanes = tl.arange(0, 32)[None, :]
    words = tl.load(mask_ptr + pid.to(tl.int64) * (BLOCK // 32) + tl.arange(0, BLOCK // 32))
    changed = tl.reshape((words[:, None] >> lanes) & 1, (BLOCK,)) != 0
    ones = changed.to(tl.int32)
    rank = tl.cumsum(ones, axis=0) - ones                 # exclusive rank of each element
    base = tl.load(offset_ptr + pid)                      # int64: changes before this program
    if GAP16:
        # Gaps in rank order: each element falls in the bin of the next change (its exclusive
        # rank), so bin k holds change k and the unchanged elements just before it. The first
        # gap also spans the elements after the last change of earlier programs.
        n_here = tl.sum(ones, axis=0)
        carried = start - tl.load(prev_last_ptr + pid) - 1
        gap = tl.histogram(rank, BLOCK).to(tl.int64) - 1
        gap = tl.minimum(gap + tl.where(local == 0, carried, 0), _ESCAPE)
        if PLANAR:
            tl.store(pos_ptr + base + local, (gap & 0xFF).to(tl.uint8), mask=local < n_here)
            tl.store(pos_ptr + count + base + local, (gap >> 8).to(tl.uint8),
                     mask=local < n_here)
        else:
            tl.store(pos_ptr + base + local, gap.to(tl.int16), mask=local < n_here)
    else:   # int32 positions: the caller guarantees numel <= 2^31
        tl.store(pos_ptr + base + rank, start.to(tl.int32) + local, mask=changed)
    x = tl.load(new_ptr + start + local, mask=changed, other=0)
    if DIFF:  # zigzag of the wrapped integer difference: +-1 -> 2, 1
        d = x - tl.load(old_ptr + start + local, mask=changed, other=0)
        x = (d << 1) ^ (d >> (8 * SIZE - 1))
    if PLANAR:
        wide = x.to(tl.int64)        # sign extension does not reach the bytes kept
        for b in tl.static_range(SIZE):
            tl.store(val_ptr + b * count + base + rank, ((wide >> (8 * b)) & 0xFF).to(tl.uint8),
                     mask=changed)
    else:
        tl.store(val_ptr + base + rank, x, mask=changed)


@triton.jit
def _load_gaps(gaps_ptr, k, valid, count, PLANAR: tl.constexpr):
    """int64 gaps 0..65535 from u16 (int16 view) or from the low/high byte planes."""
    if PLANAR:
        g = tl.load(gaps_ptr + k, mask=valid, other=0).to(tl.int64) | \
            (tl.load(gaps_ptr + count + k, mask=valid, other=0).to(tl.int64) << 8)
    else:
        g = tl.load(gaps_ptr + k, mask=valid, other=0).to(tl.int64) & 0xFFFF
    return g


@triton.jit
def _gap_sums_kernel(gaps_ptr, sums_ptr, count, PLANAR: tl.constexpr, BLOCK: tl.constexpr):
    """Per program: sum of (gap + 1) over non-escaped gaps, and the number of escapes."""
    pid = tl.program_id(0)
    k = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = k < count
    g = _load_gaps(gaps_ptr, k, valid, count, PLANAR)
    escaped = (g == _ESCAPE) & valid
    tl.store(sums_ptr + pid.to(tl.int64) * 2, tl.sum(tl.where(valid & ~escaped, g + 1, 0), axis=0))
    tl.store(sums_ptr + pid.to(tl.int64) * 2 + 1, tl.sum(escaped.to(tl.int64), axis=0))


@triton.jit
def _gap_positions_kernel(gaps_ptr, esc_ptr, base_ptr, esc_start_ptr, pos_ptr, count,
                          PLANAR: tl.constexpr, BLOCK: tl.constexpr):
    """positions = base of this program + inclusive scan of (gap + 1), escapes substituted."""
    pid = tl.program_id(0)
    k = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = k < count
    g = _load_gaps(gaps_ptr, k, valid, count, PLANAR)
    escaped = ((g == _ESCAPE) & valid).to(tl.int64)
    esc_rank = tl.load(esc_start_ptr + pid) + tl.cumsum(escaped, axis=0) - escaped
    g = tl.where(escaped != 0, tl.load(esc_ptr + esc_rank, mask=escaped != 0, other=0), g)
    pos = tl.load(base_ptr + pid) + tl.cumsum(tl.where(valid, g + 1, 0), axis=0)
    tl.store(pos_ptr + k, pos, mask=valid)


@triton.jit
def _new_values(old, val_ptr, k, valid, count, MAXPOS: tl.constexpr, DIFF: tl.constexpr,
                PLANAR: tl.constexpr, SIZE: tl.constexpr):
    """New bit patterns of changes ``k`` (raw or zigzag difference; element-major or planes)."""
    if PLANAR:
        v64 = tl.zeros(k.shape, tl.uint64)
        for b in tl.static_range(SIZE):
            byte = tl.load(val_ptr + b * count + k, mask=valid, other=0)
            v64 = v64 | (byte.to(tl.uint64) << (8 * b))
        v = v64.to(old.dtype)
    else:
        v = tl.load(val_ptr + k, mask=valid, other=0)
    if DIFF:  # old + unzigzag(v), wrapping; MAXPOS makes the shift logical
        v = old + (((v >> 1) & MAXPOS) ^ (-(v & 1)))
    return v


@triton.jit
def _verify_kernel(target_ptr, pos_ptr, val_ptr, seg_ptr, partial_ptr, n, count,
                   MAXPOS: tl.constexpr, DIFF: tl.constexpr, PLANAR: tl.constexpr,
                   SIZE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """One read of the target: partial[pid] = (S of this program's elements, sum of
    term(new) - term(old) over the changes inside it). Positions are sorted, so those changes
    are the slice seg[pid]:seg[pid + 1]; their old values were just loaded (cache hits)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    local = tl.arange(0, BLOCK)
    in_bounds = local < tl.minimum(n - start, BLOCK).to(tl.int32)
    x = tl.load(target_ptr + start + local, mask=in_bounds, other=0)
    lo, hi = _block_word_index(start, local, SIZE)
    _store_sum(partial_ptr + pid.to(tl.int64) * 4,
               tl.sum(tl.where(in_bounds, _element_terms(x, lo, hi, SIZE), 0), axis=0))
    first = tl.load(seg_ptr + pid)
    last = tl.load(seg_ptr + pid + 1)
    delta = tl.zeros([CHUNK], tl.uint64)
    for k0 in range(first, last, CHUNK):
        k = k0 + tl.arange(0, CHUNK)
        valid = k < last
        p = tl.load(pos_ptr + k, mask=valid, other=0)
        old = tl.load(target_ptr + p, mask=valid, other=0)
        v = _new_values(old, val_ptr, k, valid, count, MAXPOS, DIFF, PLANAR, SIZE)
        plo, phi = _gathered_word_index(p, SIZE)
        terms = _element_terms(v, plo, phi, SIZE) - _element_terms(old, plo, phi, SIZE)
        delta += tl.where(valid, terms, 0)
    _store_sum(partial_ptr + pid.to(tl.int64) * 4 + 2, tl.sum(delta, axis=0))


@triton.jit
def _scatter_kernel(pos_ptr, target_ptr, val_ptr, count, MAXPOS: tl.constexpr,
                    DIFF: tl.constexpr, PLANAR: tl.constexpr, SIZE: tl.constexpr,
                    BLOCK: tl.constexpr):
    """target[pos] = new value. Positions are distinct: programs never race."""
    pid = tl.program_id(0)
    k = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = k < count
    p = tl.load(pos_ptr + k, mask=valid, other=0)
    if DIFF:
        old = tl.load(target_ptr + p, mask=valid, other=0)
    else:
        old = tl.zeros([BLOCK], target_ptr.dtype.element_ty)
    v = _new_values(old, val_ptr, k, valid, count, MAXPOS, DIFF, PLANAR, SIZE)
    tl.store(target_ptr + p, v, mask=valid)


# ------------------------------------------------------------------------------ launchers
def _grid(n, block):
    return (triton.cdiv(n, block),)


def checksum_partials(x, partials, *, block, num_warps):
    """partials: int64 [cdiv(n, block), 2]."""
    if x.numel():
        _checksum_kernel[_grid(x.numel(), block)](x, partials, x.numel(), SIZE=x.element_size(),
                                                   BLOCK=block, num_warps=num_warps)


def encode_scan(new, old, mask_words, stats, *, hash_old, block, num_warps):
    """mask_words: int32 [programs * block / 32]; stats: int64 [programs, STATS]."""
    if new.numel():
        _encode_scan_kernel[_grid(new.numel(), block)](
            new, old, mask_words, stats, new.numel(), HASH_OLD=hash_old,
            SIZE=new.element_size(), BLOCK=block, num_warps=num_warps)


def encode_write(new, old, mask_words, offsets, prev_last, positions, values, count, *, gap16,
                 diff, planar, block, num_warps):
    if count:
        _encode_write_kernel[_grid(new.numel(), block)](
            new, old, mask_words, offsets, prev_last, positions, values, count, GAP16=gap16,
            DIFF=diff, PLANAR=planar, SIZE=new.element_size(), BLOCK=block, num_warps=num_warps)


def gap_sums(gaps, sums, count, *, planar, block, num_warps):
    if count:
        _gap_sums_kernel[_grid(count, block)](gaps, sums, count, PLANAR=planar, BLOCK=block,
                                              num_warps=num_warps)


def gap_positions(gaps, escapes, base, esc_start, positions, count, *, planar, block, num_warps):
    if count:
        _gap_positions_kernel[_grid(count, block)](gaps, escapes, base, esc_start, positions,
                                                   count, PLANAR=planar, BLOCK=block,
                                                   num_warps=num_warps)


def _maxpos(size):
    return (1 << (8 * size - 1)) - 1


def verify(target, positions, values, seg, partials, count, *, diff, planar, block, chunk,
           num_warps):
    """partials: int64 [cdiv(n, block), 4]; seg: int64 [programs + 1] slices of positions."""
    if target.numel():
        size = target.element_size()
        _verify_kernel[_grid(target.numel(), block)](
            target, positions, values, seg, partials, target.numel(), count,
            MAXPOS=_maxpos(size), DIFF=diff, PLANAR=planar, SIZE=size, BLOCK=block,
            CHUNK=chunk, num_warps=num_warps)


def scatter(positions, target, values, count, *, diff, planar, block, num_warps):
    if count:
        size = target.element_size()
        _scatter_kernel[_grid(count, block)](
            positions, target, values, count, MAXPOS=_maxpos(size), DIFF=diff, PLANAR=planar,
            SIZE=size, BLOCK=block, num_warps=num_warps)


# ------------------------------------------------------------------------ AOT configurations
_INT = {1: "*i8", 2: "*i16", 4: "*i32", 8: "*i64"}


def _spec(name, kernel, signature, constexprs, num_warps):
    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    return AotSpec(name, kernel, sig, constexprs, num_warps=num_warps)


def _delta_aot_specs(block=2048, num_warps=8):
    """Every kernel at the GPU default tiles, for each element size the codec supports."""
    specs = []
    for size in (1, 2, 4, 8):
        elem, tag = _INT[size], _INT[size][1:]
        specs.append(_spec(f"delta_checksum[{tag}]", _checksum_kernel,
                           {"x_ptr": elem, "partial_ptr": "*i64", "n": "i64"},
                           dict(SIZE=size, BLOCK=block), num_warps))
        for hash_old in (False, True) if size in (2, 8) else (False,):
            specs.append(_spec(f"delta_encode_scan[{tag},hash_old={hash_old}]",
                               _encode_scan_kernel,
                               {"new_ptr": elem, "old_ptr": elem, "mask_ptr": "*i32",
                                "stats_ptr": "*i64", "n": "i64"},
                               dict(HASH_OLD=hash_old, SIZE=size, BLOCK=block), num_warps))
        for gap16, diff_planar in ((False, False), (True, False), (True, True)):
            pos = "*u8" if diff_planar else ("*i16" if gap16 else "*i32")
            specs.append(_spec(
                f"delta_encode_write[{tag},{'gap16' if gap16 else 'int32'}"
                f"{',diff,planar' if diff_planar else ''}]", _encode_write_kernel,
                {"new_ptr": elem, "old_ptr": elem, "mask_ptr": "*i32", "offset_ptr": "*i64",
                 "prev_last_ptr": "*i64", "pos_ptr": pos,
                 "val_ptr": "*u8" if diff_planar else elem, "count": "i64"},
                dict(GAP16=gap16, DIFF=diff_planar, PLANAR=diff_planar, SIZE=size, BLOCK=block),
                num_warps))
        for diff_planar in (False, True):
            tag2 = "diff,planar" if diff_planar else "raw"
            vals = "*u8" if diff_planar else elem
            specs.append(_spec(
                f"delta_verify[{tag},{tag2}]", _verify_kernel,
                {"target_ptr": elem, "pos_ptr": "*i64", "val_ptr": vals, "seg_ptr": "*i64",
                 "partial_ptr": "*i64", "n": "i64", "count": "i64"},
                dict(MAXPOS=_maxpos(size), DIFF=diff_planar, PLANAR=diff_planar, SIZE=size,
                     BLOCK=block, CHUNK=VERIFY_CHUNK), num_warps))
            specs.append(_spec(
                f"delta_scatter[{tag},{tag2}]", _scatter_kernel,
                {"pos_ptr": "*i64", "target_ptr": elem, "val_ptr": vals, "count": "i64"},
                dict(MAXPOS=_maxpos(size), DIFF=diff_planar, PLANAR=diff_planar, SIZE=size,
                     BLOCK=block), num_warps))
    for planar in (False, True):
        gaps = "*u8" if planar else "*i16"
        specs.append(_spec(f"delta_gap_sums[planar={planar}]", _gap_sums_kernel,
                           {"gaps_ptr": gaps, "sums_ptr": "*i64", "count": "i64"},
                           dict(PLANAR=planar, BLOCK=block), num_warps))
        specs.append(_spec(f"delta_gap_positions[planar={planar}]", _gap_positions_kernel,
                           {"gaps_ptr": gaps, "esc_ptr": "*i64", "base_ptr": "*i64",
                            "esc_start_ptr": "*i64", "pos_ptr": "*i64", "count": "i64"},
                           dict(PLANAR=planar, BLOCK=block), num_warps))
    return specs


AOT_SPECS = _delta_aot_specs()
