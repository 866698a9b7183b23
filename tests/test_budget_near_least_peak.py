"""Budgets near the least feasible peak (core only, random planner models).

Budgets judge plans by the peak a BFC allocator reaches (`strategies.allocator_peak`).
"""

import re

import pytest

from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import strategies
from tests.random_models import random_model


def test_a_budget_that_the_speed_plan_fits_is_not_refused():
    # On this model the cut model's least-peak candidates are priced at 114 MiB
    # (136 MiB as the allocator counts them) while the 'speed' plan (keeping
    # only what must be kept) is priced at 96 MiB (103 MiB): a budget between
    # them was refused as infeasible, the error naming 114 MiB as the smallest
    # feasible budget.
    model = random_model(3, ops=43)
    speed = strategies.allocator_peak(model, strategies.speed(model))
    least = strategies.allocator_peak(model, strategies.least_peak(model))
    assert speed < least  # the case this test is about
    max_bytes = (speed + least) / 2
    result = budgets.budget(max_bytes)(model)
    assert result.estimate.allocator_peak_bytes <= max_bytes


def test_the_refusal_names_the_smallest_budget_a_plan_fits():
    model = random_model(3, ops=43)
    speed = strategies.allocator_peak(model, strategies.speed(model))
    expected = ("smallest feasible budget on this graph is " + budgets.describe_bytes(speed))
    with pytest.raises(ValueError, match=re.escape(expected)):
        budgets.budget(speed - 1)(model)
    assert budgets.budget(speed)(model).estimate.allocator_peak_bytes == speed  # it is feasible


def test_budgets_are_judged_as_the_allocator_counts():
    # Between the least bytes requested and the least allocator peak, a budget
    # the bytes requested would meet is refused: the allocator's chunks overshoot it.
    model = random_model(3, ops=43)
    plans = strategies.low_peak_candidates(model) + [strategies.speed(model)]
    requested = min(r.peak_bytes for r in plans)
    chunks = min(strategies.allocator_peak(model, r) for r in plans)
    assert requested < chunks  # the case this test is about
    with pytest.raises(ValueError, match="as a BFC allocator counts it"):
        budgets.budget((requested + chunks) / 2)(model)
