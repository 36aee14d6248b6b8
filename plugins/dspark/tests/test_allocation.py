"""Confidence-scheduled allocation against a brute-force optimum."""

from __future__ import annotations

import itertools
import random

import pytest
from deepinfer_dspark import allocate_verification, expected_accepted


def brute_force(confidences, budget):
    """The best expected accepted tokens over every allocation within the budget."""
    ranges = [range(len(row) + 1) for row in confidences]
    return max(expected_accepted(confidences, lengths) for lengths in itertools.product(*ranges)
               if sum(lengths) <= budget)


@pytest.mark.parametrize("seed", range(40))
def test_greedy_allocation_is_optimal_on_small_batches(seed):
    rng = random.Random(seed)
    S, k = rng.randint(1, 4), rng.randint(1, 4)
    confidences = [[round(rng.random(), 2) for _ in range(k)] for _ in range(S)]
    if seed % 5 == 0:  # exact ties and certain tokens
        confidences[0] = [1.0] * k
    budget = rng.randint(0, S * k + 1)
    lengths = allocate_verification(confidences, budget)
    assert sum(lengths) <= budget
    assert all(0 <= n <= k for n in lengths)
    assert expected_accepted(confidences, lengths) == pytest.approx(brute_force(confidences, budget), abs=1e-12)


def test_the_budget_goes_to_the_largest_products_along_prefixes():
    # gains: seq 0: 0.9, 0.81, 0.405; seq 1: 0.95, 0.19, 0.19
    confidences = [[0.9, 0.9, 0.5], [0.95, 0.2, 1.0]]
    assert allocate_verification(confidences, 1) == [0, 1]
    assert allocate_verification(confidences, 3) == [2, 1]
    assert allocate_verification(confidences, 4) == [3, 1]
    assert allocate_verification(confidences, 6) == [3, 3]
    assert allocate_verification(confidences, 0) == [0, 0]


def test_zero_gains_are_never_bought_and_ragged_rows_work():
    assert allocate_verification([[0.0, 1.0], [0.5], []], 5) == [0, 1, 0]


@pytest.mark.parametrize(("confidences", "budget", "match"), [
    ([[1.2]], 1, "confidences must lie in \\[0, 1\\]; sequence 0 has 1.2"),
    ([[0.5]], -1, "budget must be >= 0"),
])
def test_bad_input_is_refused(confidences, budget, match):
    with pytest.raises(ValueError, match=match):
        allocate_verification(confidences, budget)
