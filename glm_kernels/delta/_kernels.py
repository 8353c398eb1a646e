"""Triton kernels of the delta codec. No validation here: callers pass flat signed-integer
views (int8/16/32/64) of contiguous tensors and outputs of the right size.

Encode is two passes with a scan of per-program totals between them (torch, on the small
[programs] arrays):
  1. ``_encode_scan_kernel`` reads new and old once: per program, the offsets of its changed
     elements compacted into a uint16 scratch (2 bytes per element, written only at changes),
     the change count and checksum sums.
  2. ``_encode_write_kernel`` works per change: reads the compacted offsets and, at changed
     positions only, new (and old for differences); writes positions or gap16 gaps (gap from
     the previous change) and values.
Apply decodes gaps with a scan in two passes (``_gap_sums_kernel``, ``_gap_positions_kernel``),
reads the target once (``_verify_kernel``: its checksum sum plus the checksum change of the
changes each program holds, found by searchsorted since positions are sorted) and, only after
the host compared both with the packet, scatters the values (``_scatter_kernel``).
Offsets are int64 throughout: tensors past 2^31 elements are addressed correctly.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._aot import AotSpec
from . import _reference as ref

_K1, _K2, _K3 = tl.constexpr(ref.K1), tl.constexpr(ref.K2), tl.constexpr(ref.K3)
_M1, _M2, _M3 = tl.constexpr(ref.M1), tl.constexpr(ref.M2), tl.constexpr(ref.M3)
_N1, _N2, _N3 = tl.constexpr(ref.N1), tl.constexpr(ref.N2), tl.constexpr(ref.N3)
_ESCAPE = tl.constexpr(ref.ESCAPE)
VERIFY_CHUNK = 256   # changes per step of the verify kernel's loop
STATS = 5   # per-program encode stats: change count, S(new) lo/hi, S(old) lo/hi
_STATS = tl.constexpr(STATS)
WRITE_CHUNK, WRITE_WARPS = 128, 4   # encode pass 2: changes per step, warps


@triton.jit
def _word_terms(w, lo, hi):
    """Checksum terms (uint64) of 32-bit words ``w`` at word index hi:lo (uint32 halves; ``hi``
    may be a scalar): (w ^ k) * (n * 2^32 + (m | 1)) mod 2^64, k, m, n from the index."""
    x = w ^ (lo * _K1 + (hi * _K2 + _K3))
    m = (lo * _M1 + (hi * _M2 + _M3)) | 1
    n = lo * _N1 + (hi * _N2 + _N3)
    return x.to(tl.uint64) * m.to(tl.uint64) + ((x * n).to(tl.uint64) << 32)


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
def _encode_scan_kernel(new_ptr, old_ptr, local_ptr, stats_ptr, n, HASH_NEW: tl.constexpr,
                        HASH_OLD: tl.constexpr, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1, one read of new and old: the offsets (within the program) of the changed
    elements, compacted to the front of the program's slice of ``local`` (uint16 in an int16
    view), and per program the change count and checksum sums."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    local = tl.arange(0, BLOCK)
    in_bounds = local < tl.minimum(n - start, BLOCK).to(tl.int32)
    x = tl.load(new_ptr + start + local, mask=in_bounds, other=0)
    y = tl.load(old_ptr + start + local, mask=in_bounds, other=0)
    ones = ((x != y) & in_bounds).to(tl.int32)
    rank = tl.cumsum(ones, axis=0) - ones
    tl.store(local_ptr + start + rank, local.to(tl.int16), mask=ones != 0)
    row = stats_ptr + pid.to(tl.int64) * _STATS
    tl.store(row, tl.sum(ones, axis=0).to(tl.int64))
    lo, hi = _block_word_index(start, local, SIZE)
    if HASH_NEW:
        _store_sum(row + 1, tl.sum(tl.where(in_bounds, _element_terms(x, lo, hi, SIZE), 0),
                                   axis=0))
    if HASH_OLD:
        _store_sum(row + 3, tl.sum(tl.where(in_bounds, _element_terms(y, lo, hi, SIZE), 0),
                                   axis=0))


@triton.jit
def _encode_write_kernel(new_ptr, old_ptr, local_ptr, counts_ptr, offset_ptr, prev_last_ptr,
                         pos_ptr, val_ptr, delta_ptr, count, GAP16: tl.constexpr,
                         DIFF: tl.constexpr, PLANAR: tl.constexpr, DELTA: tl.constexpr,
                         SIZE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Pass 2, work proportional to the changes: change j of program p goes to slot
    offset[p] + j; its gap is taken from the previous change (or the last change of earlier
    programs for j = 0). DELTA: also delta[p] = sum of term(new) - term(old) over them."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    n_here = tl.load(counts_ptr + pid)
    base = tl.load(offset_ptr + pid)
    acc = tl.zeros([CHUNK], tl.uint64)
    for k0 in range(0, n_here, CHUNK):
        k = k0 + tl.arange(0, CHUNK)
        valid = k < n_here
        pos = start + (tl.load(local_ptr + start + k, mask=valid, other=0).to(tl.int32) & 0xFFFF)
        if GAP16:
            before = tl.load(local_ptr + start + k - 1, mask=valid & (k > 0), other=0)
            prev = tl.where(k > 0, start + (before.to(tl.int32) & 0xFFFF),
                            tl.load(prev_last_ptr + pid))
            gap = tl.minimum(pos - prev - 1, _ESCAPE)
            if PLANAR:
                tl.store(pos_ptr + base + k, (gap & 0xFF).to(tl.uint8), mask=valid)
                tl.store(pos_ptr + count + base + k, (gap >> 8).to(tl.uint8), mask=valid)
            else:
                tl.store(pos_ptr + base + k, gap.to(tl.int16), mask=valid)
        else:   # int32 positions: the caller guarantees numel <= 2^31
            tl.store(pos_ptr + base + k, pos.to(tl.int32), mask=valid)
        x = tl.load(new_ptr + pos, mask=valid, other=0)
        if DIFF or DELTA:
            y = tl.load(old_ptr + pos, mask=valid, other=0)
        if DELTA:
            plo, phi = _gathered_word_index(pos, SIZE)
            acc += tl.where(valid, _element_terms(x, plo, phi, SIZE) -
                            _element_terms(y, plo, phi, SIZE), 0)
        if DIFF:  # zigzag of the wrapped integer difference: +-1 -> 2, 1
            d = x - y
            x = (d << 1) ^ (d >> (8 * SIZE - 1))
        if PLANAR:
            wide = x.to(tl.int64)        # sign extension does not reach the bytes kept
            for b in tl.static_range(SIZE):
                tl.store(val_ptr + b * count + base + k, ((wide >> (8 * b)) & 0xFF).to(tl.uint8),
                         mask=valid)
        else:
            tl.store(val_ptr + base + k, x, mask=valid)
    if DELTA:
        _store_sum(delta_ptr + pid.to(tl.int64) * 2, tl.sum(acc, axis=0))


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


def encode_scan(new, old, local, stats, *, hash_new, hash_old, block, num_warps):
    """local: int16 [n] scratch; stats: int64 [programs, STATS]."""
    if new.numel():
        _encode_scan_kernel[_grid(new.numel(), block)](
            new, old, local, stats, new.numel(), HASH_NEW=hash_new, HASH_OLD=hash_old,
            SIZE=new.element_size(), BLOCK=block, num_warps=num_warps)


def encode_write(new, old, local, counts, offsets, prev_last, positions, values, deltas, count,
                 *, gap16, diff, planar, block):
    """deltas: int64 [programs, 2] checksum-change halves, or None (not computed)."""
    if count:
        _encode_write_kernel[_grid(new.numel(), block)](
            new, old, local, counts, offsets, prev_last, positions, values,
            counts if deltas is None else deltas, count, GAP16=gap16, DIFF=diff,
            PLANAR=planar, DELTA=deltas is not None, SIZE=new.element_size(), BLOCK=block,
            CHUNK=WRITE_CHUNK, num_warps=WRITE_WARPS, num_stages=1)


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
            CHUNK=chunk, num_warps=num_warps, num_stages=1)


def scatter(positions, target, values, count, *, diff, planar, block, num_warps):
    if count:
        size = target.element_size()
        _scatter_kernel[_grid(count, block)](
            positions, target, values, count, MAXPOS=_maxpos(size), DIFF=diff, PLANAR=planar,
            SIZE=size, BLOCK=block, num_warps=num_warps)


# ------------------------------------------------------------------------ AOT configurations
_INT = {1: "*i8", 2: "*i16", 4: "*i32", 8: "*i64"}


def _spec(name, kernel, signature, constexprs, num_warps, num_stages=3):
    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    return AotSpec(name, kernel, sig, constexprs, num_warps=num_warps, num_stages=num_stages)


def _delta_aot_specs(num_warps=8):
    """The kernels at the GPU default tiles (``_device.default_config``): every variant for
    2-byte (bf16/fp16) and 8-byte elements, the main path for 1- and 4-byte ones."""
    specs = []
    for size in (1, 2, 4, 8):
        block = 2048 if size == 8 else 4096
        every = size in (2, 8)
        elem, tag = _INT[size], _INT[size][1:]
        specs.append(_spec(f"delta_checksum[{tag}]", _checksum_kernel,
                           {"x_ptr": elem, "partial_ptr": "*i64", "n": "i64"},
                           dict(SIZE=size, BLOCK=block), num_warps))
        for hashes in ((True, False), (True, True), (False, False)) if every else ((True, False),):
            specs.append(_spec(f"delta_encode_scan[{tag},hash_new={hashes[0]},"
                               f"hash_old={hashes[1]}]", _encode_scan_kernel,
                               {"new_ptr": elem, "old_ptr": elem, "local_ptr": "*i16",
                                "stats_ptr": "*i64", "n": "i64"},
                               dict(HASH_NEW=hashes[0], HASH_OLD=hashes[1], SIZE=size,
                                    BLOCK=block), num_warps))
        for gap16, diff_planar in ((False, False), (True, False), (True, True)) if every else \
                ((True, False),):
            pos = "*u8" if diff_planar else ("*i16" if gap16 else "*i32")
            specs.append(_spec(
                f"delta_encode_write[{tag},{'gap16' if gap16 else 'int32'}"
                f"{',diff,planar' if diff_planar else ''}]", _encode_write_kernel,
                {"new_ptr": elem, "old_ptr": elem, "local_ptr": "*i16", "counts_ptr": "*i64",
                 "offset_ptr": "*i64", "prev_last_ptr": "*i64", "pos_ptr": pos,
                 "val_ptr": "*u8" if diff_planar else elem, "delta_ptr": "*i64", "count": "i64"},
                dict(GAP16=gap16, DIFF=diff_planar, PLANAR=diff_planar, DELTA=gap16,
                     SIZE=size, BLOCK=block, CHUNK=WRITE_CHUNK), WRITE_WARPS, num_stages=1))
        for diff_planar in (False, True) if every else (False,):
            tag2 = "diff,planar" if diff_planar else "raw"
            vals = "*u8" if diff_planar else elem
            specs.append(_spec(
                f"delta_verify[{tag},{tag2}]", _verify_kernel,
                {"target_ptr": elem, "pos_ptr": "*i64", "val_ptr": vals, "seg_ptr": "*i64",
                 "partial_ptr": "*i64", "n": "i64", "count": "i64"},
                dict(MAXPOS=_maxpos(size), DIFF=diff_planar, PLANAR=diff_planar, SIZE=size,
                     BLOCK=block, CHUNK=VERIFY_CHUNK), num_warps, num_stages=1))
            if every:
                specs.append(_spec(
                    f"delta_scatter[{tag},{tag2}]", _scatter_kernel,
                    {"pos_ptr": "*i64", "target_ptr": elem, "val_ptr": vals, "count": "i64"},
                    dict(MAXPOS=_maxpos(size), DIFF=diff_planar, PLANAR=diff_planar, SIZE=size,
                         BLOCK=block), num_warps))
    for planar in (False, True):
        gaps = "*u8" if planar else "*i16"
        specs.append(_spec(f"delta_gap_sums[planar={planar}]", _gap_sums_kernel,
                           {"gaps_ptr": gaps, "sums_ptr": "*i64", "count": "i64"},
                           dict(PLANAR=planar, BLOCK=4096), num_warps))
        specs.append(_spec(f"delta_gap_positions[planar={planar}]", _gap_positions_kernel,
                           {"gaps_ptr": gaps, "esc_ptr": "*i64", "base_ptr": "*i64",
                            "esc_start_ptr": "*i64", "pos_ptr": "*i64", "count": "i64"},
                           dict(PLANAR=planar, BLOCK=4096), num_warps))
    return specs


AOT_SPECS = _delta_aot_specs()
