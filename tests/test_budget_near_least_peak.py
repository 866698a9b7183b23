"""Budgets near the least feasible peak (core only, random planner models)."""

import re

import pytest

from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import strategies
from tests.random_models import random_model


def test_a_budget_that_tf_gradients_fits_is_not_refused():
    # On this model the cut model's least-peak candidates are priced at 114 MiB
    # and the 'speed' plan (keeping only what must be kept) at 96 MiB, both
    # above tf.gradients' 89 MiB: a budget between 96 and 114 MiB was refused
    # as infeasible, then (eea4a3d) given the 'speed' plan. Now the least
    # peak is tf.gradients' own, and a budget it fits recomputes nothing.
    model = random_model(3, ops=43)
    least = strategies.least_peak(model)
    assert least.plan.stock and strategies.speed(model).plan.stock
    max_bytes = least.peak_bytes + 15 * 2**20
    result = budgets.budget(max_bytes)(model)
    assert result.peak_bytes <= max_bytes and result.recompute_flops == 0


def test_the_refusal_names_the_smallest_budget_a_plan_fits():
    model = random_model(3, ops=43)
    speed = strategies.speed(model)
    expected = ("smallest feasible budget on this graph is "
                + budgets.describe_bytes(speed.peak_bytes))
    with pytest.raises(ValueError, match=re.escape(expected)):
        budgets.budget(speed.peak_bytes - 1)(model)
