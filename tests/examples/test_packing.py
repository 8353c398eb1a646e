"""Micro-batch packing over simulated data-parallel ranks: every rank gets the same number of
micro-batches (a rank with fewer would wait at, or hang, the others' gradient collective),
none over the token budget, every sample exactly once; over random length sets."""
import random

import pytest

from examples.async_trainer.train.packing import assign_to_ranks, split_to_count


@pytest.mark.parametrize("method", ["kk", "first_fit"])
def test_every_rank_gets_the_same_number_of_micro_batches_within_budget(method):
    rng = random.Random(1234)
    unequal_before = 0
    for _ in range(600):
        budget = rng.randint(16, 256)
        n, ranks = rng.randint(1, 64), rng.randint(1, 8)
        lengths = [rng.randint(1, budget) for _ in range(n)]
        out = assign_to_ranks(lengths, ranks, budget, method)
        assert len(out) == ranks
        counts = {len(r) for r in out}
        assert len(counts) == 1, (lengths, ranks, budget, [len(r) for r in out])
        placed = sorted(i for r in out for mb in r for i in mb)
        assert placed == list(range(n))
        assert all(sum(lengths[i] for i in mb) <= budget for r in out for mb in r)
        # A micro-batch is empty only where its rank has fewer samples than the count.
        for r in out:
            if any(not mb for mb in r):
                assert sum(len(mb) for mb in r) < len(r)
        unequal_before += len({len(r) for r in _unequalized(lengths, ranks, budget, method)}) > 1
    assert unequal_before > 0          # the sets do exercise ranks that needed different counts


def _unequalized(lengths, ranks, budget, method):
    """What each rank needs on its own: the count before equalizing (first-fit per rank)."""
    from examples.async_trainer.train.packing import first_fit, karmarkar_karp
    if method == "kk":
        return [first_fit([lengths[i] for i in idx], budget)
                for idx in karmarkar_karp(lengths, ranks)]
    bins = first_fit(lengths, budget)
    return [bins[r::ranks] for r in range(ranks)]


def test_split_to_count_halves_the_heaviest_bin_and_pads_when_out_of_samples():
    lengths = [5, 4, 3, 2]
    out = split_to_count([[0, 1, 2, 3]], lengths, 3)
    assert len(out) == 3 and sorted(i for b in out for i in b) == [0, 1, 2, 3]
    assert split_to_count([[0]], lengths, 3) == [[0], [], []]
