"""`"memory"`'s candidates chosen as for a larger batch, taken only where no worse by either count.

Where the weight gradients outweigh the activations, they set every plan's
held peak alike, and the cut model's least-peak plans at the traced sizes can
leave a tail of activations unchecked (ResNet101 at 64 px, batch 8: 0.56 of
tf.gradients' activations measured). Its plans chosen with every activation
each of `strategies.LARGER_BATCHES` times as large are priced at the traced sizes beside
them; one is taken only where it peaks no higher than the traced choice with
the weight gradients held and with each taken as it is made. Planner models
only, no TensorFlow graphs.
"""

import dataclasses

import pytest

from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import cuts
from memory_saving_gradients.core import pricing
from memory_saving_gradients.core import solvers
from memory_saving_gradients.core import strategies
from random_models import random_model
from test_selection import chain_model


def traced_choice(model):
    """What `least_peak` took before the larger batch's candidates: `_chosen`
    over the traced sizes' candidates alone."""
    traced, _ = strategies._traced_and_larger(model, strategies.cut_problem(model))
    return strategies._chosen(model, "memory", traced)[0]


def both_counts(model, result):
    return result.peak_bytes, pricing.activation_peak(model, result.plan)


def test_scaling_multiplies_activations_and_keeps_weight_gradients():
    model = random_model(0, ops=60)
    problem = strategies.cut_problem(model)
    scaled = cuts.with_activations_scaled(problem, 4)
    assert (scaled.op_bytes == 4 * problem.op_bytes).all()
    assert (scaled.op_held == 4 * problem.op_held).all()
    assert (scaled.op_weights == problem.op_weights).all() and problem.op_weights.any()
    assert (scaled.cuts == problem.cuts).all()


@pytest.mark.parametrize("seed, ops", [(0, 60), (18, 60), (21, 60)])
def test_a_larger_batch_plan_lower_by_both_counts_is_taken(seed, ops):
    """On these random models the larger batch's plan peaks 10-34 MiB lower
    with the weight gradients held, and lower as taken, than the traced
    sizes' choice."""
    model = random_model(seed, ops=ops)
    before, now = traced_choice(model), strategies.memory(model)
    held, taken = both_counts(model, now)
    assert held < before.peak_bytes
    assert taken <= pricing.activation_peak(model, before.plan)
    assert any("4x as large" in note for note in now.notes), now.notes
    assert strategies.least_peak(model).peak_bytes == held


@pytest.mark.parametrize("seed, ops", [(14, 30), (51, 60), (17, 60)])
def test_a_sixteen_fold_batch_plan_is_taken_where_it_is_lower_by_both_counts(
        monkeypatch, seed, ops):
    """The further the weight gradients outweigh the activations, the larger
    the batch whose plans keep few activations: on these random models a plan
    chosen as for a 16x batch peaks 3-17 MiB lower by both counts than what
    the traced and 4x plans give (VGG19 at 64 px: as taken 34.9 -> 31.5 MiB,
    recompute 6.2 -> 1.3 GFLOPs)."""
    model = random_model(seed, ops=ops)
    now = strategies.memory(model)
    assert any("16x as large" in note for note in now.notes), now.notes
    monkeypatch.setattr(strategies, "LARGER_BATCHES", (4,))
    before = strategies.memory(model)
    assert all(a < b for a, b in zip(both_counts(model, now), both_counts(model, before)))


def test_a_larger_batch_plan_keeping_more_as_taken_is_not_taken():
    """On this random model a larger batch's plan ties with the traced choice
    with the weight gradients held (183 MiB) and recomputes less, but keeps
    more with each taken as it is made (192 MiB): ranked with the others it
    would win on recompute (InceptionV3 at 64 px: 10% more activations)."""
    model = random_model(62, ops=60)
    before = traced_choice(model)
    _, larger = strategies._traced_and_larger(model, strategies.cut_problem(model))
    tempting = [r for r in larger if r.peak_bytes <= before.peak_bytes
                and r.recompute_flops < before.recompute_flops
                and pricing.activation_peak(model, r.plan)
                > pricing.activation_peak(model, before.plan)]
    assert tempting
    least = strategies.least_peak(model)
    assert least.chosen == before.chosen
    assert all(strategies.memory(model).chosen != r.chosen for r in tempting)


def test_no_larger_batch_candidates_without_weight_gradients(monkeypatch):
    """Without weight gradients every cut-model peak scales with the batch:
    the same plans, not solved twice."""
    model, _ = chain_model(60)
    problem = strategies.cut_problem(model)
    assert not problem.op_weights.any()
    solved = []
    low_peak_plans = solvers.low_peak_plans
    monkeypatch.setattr(solvers, "low_peak_plans",
                        lambda problem, *args: solved.append(problem) or low_peak_plans(
                            problem, *args))
    assert strategies._traced_and_larger(model, problem)[1] == []
    assert len(solved) == 1


@pytest.mark.parametrize("taken", [False, True])
@pytest.mark.parametrize("seed, ops", [(13, 60), (127, 60), (0, 60), (62, 60)])
def test_memory_is_never_above_its_plan_without_them(monkeypatch, seed, ops, taken):
    """`"memory"` with the larger batch's candidates peaks no higher by either
    count than without them. Judged against the traced sizes' least-peak plan
    rather than their final one, it was 2 MiB higher by both on the first two
    (a review's find): the search for a cheaper plan at the traced least peak
    had found one below it, which the lower least-peak plan's search did not."""
    model = dataclasses.replace(random_model(seed, ops=ops), weight_gradients_taken=taken)
    monkeypatch.setattr(strategies, "LARGER_BATCHES", ())
    before = both_counts(model, strategies.memory(model))
    monkeypatch.undo()
    now = both_counts(model, strategies.memory(model))
    assert now[0] <= before[0] and now[1] <= before[1]


@pytest.mark.parametrize("seed", [9, 1, 126])
def test_larger_batch_plans_below_stock_are_taken_where_the_traced_ones_are_not(
        monkeypatch, seed):
    """Where no plan chosen at the traced sizes is below tf.gradients by both
    counts (`"memory"` would return the stock gradient), one chosen as for a
    larger batch that is below it both ways is taken (random models of 30
    ops; on the first, stock 92 / 92 MiB, the larger batch's plans 90 / 90)."""
    monkeypatch.setattr(strategies, "STOCK_FALLBACK", True)
    model = random_model(seed, ops=30)
    assert traced_choice(model).plan.stock
    for result in (strategies.memory(model), strategies.least_peak(model)):
        assert not result.plan.stock, result.notes
        stock = strategies.stock(model, "stock")
        assert all(now < then for now, then in zip(both_counts(model, result),
                                                   both_counts(model, stock)))


def test_the_least_feasible_budget_follows_the_larger_batches(monkeypatch):
    """The budgets' feasible plans are remembered per model and setting: asked
    again on the same model with the larger batches' candidates, the least
    feasible budget is theirs (it was the first answer, remembered under one
    key; a review's find)."""
    model = random_model(51, ops=60)
    monkeypatch.setattr(strategies, "LARGER_BATCHES", ())
    without = budgets.least_feasible(model).estimate.allocator_peak_bytes
    monkeypatch.undo()
    assert budgets.least_feasible(model).estimate.allocator_peak_bytes < without
