"""Budgets near the least feasible peak (core only, random planner models)."""

import re

import pytest

from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import strategies
from tests.random_models import random_model


def test_a_budget_that_the_speed_plan_fits_is_not_refused():
    # On this model the cut model's least-peak candidates are priced at 114 MiB
    # while the 'speed' plan (keeping only what must be kept) is priced at
    # 96 MiB: a budget between them was refused as infeasible, the error
    # naming 114 MiB as the smallest feasible budget.
    model = random_model(3, ops=43)
    speed = strategies.speed(model)
    least = strategies.least_peak(model)
    assert speed.peak_bytes < least.peak_bytes  # the case this test is about
    max_bytes = (speed.peak_bytes + least.peak_bytes) / 2
    result = budgets.budget(max_bytes)(model)
    assert result.peak_bytes <= max_bytes


def test_the_refusal_names_the_smallest_budget_a_plan_fits():
    model = random_model(3, ops=43)
    speed = strategies.speed(model)
    expected = ("smallest feasible budget on this graph is "
                + budgets.describe_bytes(speed.peak_bytes))
    with pytest.raises(ValueError, match=re.escape(expected)):
        budgets.budget(speed.peak_bytes - 1)(model)
