"""How a budget's plan differentiates loops (`core/loop_plans.py`), on random models. No TF graphs."""

import pytest

from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import loop_plans
from memory_saving_gradients.core import pricing
from memory_saving_gradients.core import strategies
from memory_saving_gradients.core.planning import LoopModes
from random_models import random_model

MODELS = [random_model(seed, ops=40 + 20 * seed) for seed in range(3)]


@pytest.mark.parametrize("model", [m for m in MODELS if loop_plans.rerunnable_loops(m)])
def test_settings_go_from_no_loop_kept_to_every_chunked_loop_stacked(model):
    loops = loop_plans.rerunnable_loops(model)
    chunked = {op for op in loops if model.loops[op].chunk_size is not None}
    found = loop_plans.settings(model)
    assert found[0] == LoopModes() and found[1] == LoopModes(frozenset(loops))
    assert [len(modes.stacked) for modes in found[1:]] == list(range(len(chunked) + 1))
    assert found[-1].stacked == chunked


@pytest.mark.parametrize("model", [m for m in MODELS if loop_plans.rerunnable_loops(m)])
@pytest.mark.parametrize("share", [0.5, 1])
def test_a_budget_recomputes_no_more_than_with_every_loop_rerun(model, share):
    """The loop settings only add plans: the budget's is at least as cheap as the
    best with the loops rerun by their levels, and fits."""
    # As a BFC allocator counts it: what budgets are judged by.
    least = budgets.least_feasible(model).estimate.allocator_peak_bytes
    limit = least + share * (pricing.allocator_baseline_bytes(model) - least) + 1
    chosen = budgets.budget(limit)(model)
    rerun = strategies._fitting(  # pylint: disable=protected-access
        model, strategies.cut_problem(model), limit, "rerun", LoopModes(),
        lambda r: strategies.allocator_peak(model, r))
    assert chosen.estimate.allocator_peak_bytes <= limit
    assert rerun is None or chosen.recompute_flops <= rerun.recompute_flops


def test_a_kept_loop_is_not_copied_and_its_inputs_and_outputs_are_kept():
    model = next(m for m in MODELS if loop_plans.rerunnable_loops(m))
    loop = loop_plans.rerunnable_loops(model)[0]
    plan = strategies.result_of(model, set(), "x", loops=LoopModes(frozenset({loop}))).plan
    assert all(loop not in level.copy_ops for level in plan.levels)
    reads = set(model.graph.predecessors(model.op_outputs[loop][0]))
    assert set(model.op_outputs[loop]) | reads <= set(plan.kept)
