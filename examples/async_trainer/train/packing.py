"""Pack variable-length samples into micro-batches spread over simulated DP ranks.

Every rank runs the same number of micro-batches (slime: the count is the maximum over the
ranks of what each needs, agreed by an all-reduce): in a real data-parallel step a rank with
fewer micro-batches would wait at, or hang, the gradient collective of the others.
"""
import heapq
from typing import List


def first_fit(lengths, max_tokens):
    """Bins (lists of indices), each with total length <= max_tokens, first-fit decreasing."""
    bins, loads = [], []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i); loads[b] += lengths[i]; break
        else:
            bins.append([i]); loads.append(lengths[i])
    return bins


def karmarkar_karp(lengths, k):
    """Partition indices into k sets of near-equal total length (largest differencing method)."""
    heap = []
    for i in range(len(lengths)):
        parts = [([i], lengths[i])] + [([], 0) for _ in range(k - 1)]
        heap.append((-lengths[i], i, parts))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, tie, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda p: p[1])             # smallest first
        b = sorted(b, key=lambda p: -p[1])            # largest first
        merged = sorted([(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b)], key=lambda p: -p[1])
        heapq.heappush(heap, (-(merged[0][1] - merged[-1][1]), tie, merged))
    return [p[0] for p in heap[0][2]] if heap else [[] for _ in range(k)]


def split_to_count(bins: List[List[int]], lengths, count: int) -> List[List[int]]:
    """``bins`` (each within the budget) made exactly ``count`` micro-batches: the heaviest
    bin of two or more samples is halved (Karmarkar-Karp, so the halves stay balanced) until
    there are enough; splitting never exceeds a budget. A rank with fewer samples than
    ``count`` gets empty micro-batches (a real rank runs a padding-only one to join the
    collective)."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins += [[] for _ in range(count - len(bins))]
            break
        big = max(splittable, key=lambda b: sum(lengths[i] for i in bins[b]))
        items = bins[big]
        halves = karmarkar_karp([lengths[i] for i in items], 2)
        bins[big] = [items[j] for j in halves[0]]
        bins.append([items[j] for j in halves[1]])
    return bins


def assign_to_ranks(lengths, dp_ranks, max_tokens, method):
    """Return ``ranks[r] = list of micro-batches (lists of sample indices)``: every sample in
    exactly one micro-batch, none over ``max_tokens``, and the same number of micro-batches
    on every rank. ``method``: ``"kk"`` balances the ranks' token totals (Karmarkar-Karp),
    then first-fit packs each rank; ``"first_fit"`` packs all samples, then deals the bins
    out round-robin."""
    if method == "kk":
        per_rank = karmarkar_karp(lengths, dp_ranks)
        ranks = [[[idx[j] for j in b] for b in first_fit([lengths[i] for i in idx], max_tokens)]
                 for idx in per_rank]
    else:
        ranks = [[] for _ in range(dp_ranks)]
        for n, b in enumerate(first_fit(lengths, max_tokens)):
            ranks[n % dp_ranks].append(b)
    count = max(len(r) for r in ranks)
    return [split_to_count(r, lengths, count) for r in ranks]
