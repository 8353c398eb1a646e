"""Pack variable-length samples into micro-batches spread over simulated DP ranks."""
import heapq


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


def assign_to_ranks(lengths, dp_ranks, max_tokens, method):
    """Return ``ranks[r] = list of micro-batches (lists of sample indices)``."""
    if method == "kk":
        per_rank = karmarkar_karp(lengths, dp_ranks)
        return [[[idx[j] for j in b] for b in first_fit([lengths[i] for i in idx], max_tokens)]
                for idx in per_rank]
    bins = first_fit(lengths, max_tokens)
    ranks = [[] for _ in range(dp_ranks)]
    for n, b in enumerate(bins):
        ranks[n % dp_ranks].append(b)
    return ranks
