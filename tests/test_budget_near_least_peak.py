"""Budgets near the least feasible peak (core only, random planner models).

Budgets judge plans by the peak a BFC allocator reaches (`strategies.allocator_peak`).
"""

import re

import pytest

from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import strategies
from tests.random_models import random_model


@pytest.mark.stock_fallback
def test_a_budget_that_tf_gradients_fits_is_not_refused():
    # On this model the cut model's least-peak candidates are priced at 114 MiB
    # and the 'speed' plan (keeping only what must be kept) at 96 MiB, both
    # above tf.gradients' 89 MiB: a budget between 96 and 114 MiB was refused
    # as infeasible, then (eea4a3d) given the 'speed' plan. Now the least
    # peak is tf.gradients' own, and a budget it fits recomputes nothing.
    model = random_model(3, ops=43)
    least = strategies.least_peak(model)
    assert least.plan.stock and strategies.speed(model).plan.stock
    max_bytes = strategies.allocator_peak(model, least) + 2**20
    result = budgets.budget(max_bytes)(model)
    assert result.plan.stock and result.recompute_flops == 0
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
