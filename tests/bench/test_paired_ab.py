"""The paired A/B's statistics (benchmarks/paired_ab.py): ratios this tree / baseline, their interval, the verdict.

Made-up costs stand in for measured windows: the verdict on the cost bound
(5 %) must follow the bootstrap interval of the median ratio, which way
round the ratio is must not flip, and the order of the sides must balance.
"""

from __future__ import annotations

import random
import statistics

from . import load_benchmark

paired_ab = load_benchmark("paired_ab", with_siblings=True)

RESAMPLES = 2000


def pairs_around(ratio: float, spread: float, n: int = 20, seed: int = 7) -> list[tuple[float, float]]:
    """``n`` pairs whose baseline drifts by ±30 % and whose ratio A/B is ``ratio`` ± ``spread``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b = 500.0 * rng.uniform(0.7, 1.3)
        out.append((b * ratio * rng.uniform(1 - spread, 1 + spread), b))
    return out


def test_the_verdict_follows_the_interval_against_the_bound() -> None:
    assert paired_ab.verdict(0.97, 1.05, 0.05) == "met"  # the upper end at the bound is within it
    assert paired_ab.verdict(0.97, 1.0501, 0.05) == "not resolved"
    assert paired_ab.verdict(1.04, 1.06, 0.05) == "not resolved"
    assert paired_ab.verdict(1.05, 1.2, 0.05) == "not resolved"  # the lower end at the bound: not past it
    assert paired_ab.verdict(1.0501, 1.2, 0.05) == "missed"
    assert paired_ab.verdict(1.06, 1.12, 0.10) == "not resolved"


def test_drifting_pairs_resolve_a_few_per_cent_either_way() -> None:
    # The baseline's cost drifts by ±30 % from pair to pair; the ratio within a pair by ±2 %.
    met = paired_ab.summarise_pairs(pairs_around(1.01, 0.02), 0.05, RESAMPLES, seed=1)
    assert met["pairs"] == 20
    assert met["verdict"] == "met"
    assert met["ci"][0] <= met["ratio_median"] <= met["ci"][1] < 1.05
    assert 0.99 < met["ratio_median"] < 1.03

    missed = paired_ab.summarise_pairs(pairs_around(1.10, 0.02), 0.05, RESAMPLES, seed=1)
    assert missed["verdict"] == "missed"
    assert 1.05 < missed["ci"][0] <= missed["ratio_median"] <= missed["ci"][1]

    # The same costs with the sides swapped: B/A ~ 0.91, well within the bound: the ratio is A over B.
    swapped = paired_ab.summarise_pairs([(b, a) for a, b in pairs_around(1.10, 0.02)], 0.05, RESAMPLES, seed=1)
    assert swapped["verdict"] == "met"
    assert swapped["ratio_median"] < 0.93


def test_a_wide_spread_around_the_bound_is_not_resolved_and_the_interval_is_seeded() -> None:
    # ratios evenly from 0.95 to 1.15 (median 1.05), the baseline drifting by ±30 %
    drift = random.Random(11)
    pairs = [(b * (0.95 + 0.2 * i / 19), b) for i in range(20) for b in [500.0 * drift.uniform(0.7, 1.3)]]
    first = paired_ab.summarise_pairs(pairs, 0.05, RESAMPLES, seed=3)
    assert first["verdict"] == "not resolved"
    assert abs(first["ratio_median"] - 1.05) < 1e-9
    assert first["ci"][0] < 1.05 < first["ci"][1]
    assert paired_ab.summarise_pairs(pairs, 0.05, RESAMPLES, seed=3) == first
    # each side's median is of its own costs, not of the ratios
    assert first["b_median"] == statistics.median(b for _, b in pairs)
    assert first["a_median"] == statistics.median(a for a, _ in pairs)


def test_too_few_pairs_give_no_verdict() -> None:
    assert paired_ab.summarise_pairs([], 0.05, RESAMPLES, seed=1)["verdict"] == "no pairs"
    one = paired_ab.summarise_pairs([(100.0, 100.0)], 0.05, RESAMPLES, seed=1)
    assert one["ci"] is None and one["verdict"] == "not resolved"
    # five pairs all at 1.00 (or all at 1.20): an interval, but 5 values cannot bound a median at 95 %
    for ratio in (1.0, 1.2):
        five = paired_ab.summarise_pairs([(100.0 * ratio, 100.0)] * 5, 0.05, RESAMPLES, seed=1)
        assert five["ci"] == [ratio, ratio] and five["verdict"] == "not resolved"
    six = paired_ab.summarise_pairs([(100.0, 100.0)] * 6, 0.05, RESAMPLES, seed=1)
    assert six["verdict"] == "met"


def test_each_side_goes_first_in_half_the_rounds() -> None:
    rng = random.Random(0)
    for cell in range(3):
        orders = [paired_ab.side_order(r, cell, "abba", rng) for r in range(20)]
        assert orders.count(("A", "B")) == orders.count(("B", "A")) == 10
        assert all(orders[r] != orders[r + 1] for r in range(19))  # ABBA: the order flips every round
    drawn = [paired_ab.side_order(r, 0, "random", random.Random(5)) for r in range(4)]
    assert drawn == [paired_ab.side_order(r, 0, "random", random.Random(5)) for r in range(4)]  # seeded
