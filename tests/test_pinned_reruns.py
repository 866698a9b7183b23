"""Pinned tensors are rebuilt whatever the plan: the cut model's `op_rerun`. No TF graphs.

A recomputable op whose output is pinned (the activation input of a stateful
op, a random op, control flow or a nested call that cannot be rerun) is kept,
and its level recomputes it from the checkpoints before it whatever else is
kept: the ops it is rebuilt from are recomputed even in the tail. The cut
model must know it, or it prices the plans with few cuts as recomputing
nothing and budgets return the least-peak plan however large they are
(ConvNeXtTiny's 18 nested depthwise-convolution calls: every budget gave the
'memory' plan).
"""

import dataclasses

import numpy as np
import pytest

import memory_saving_gradients as msg
from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import cuts
from memory_saving_gradients.core import pricing
from memory_saving_gradients.core import solvers
from memory_saving_gradients.core import strategies
from test_selection import make_model

STATEFUL_AT = (15, 30, 45)  # positions of the ops that cannot be rerun


def chain_with_stateful_ops(n=60, size=100):
    """A chain of n ops of `size` bytes whose gradients read their inputs (a
    matmul's), ops at `STATEFUL_AT` not recomputable: they and their inputs
    are pinned."""
    names = [f"t{i:03d}" for i in range(n)]
    stateful = {names[k] for k in STATEFUL_AT}
    pinned = stateful | {names[k - 1] for k in STATEFUL_AT}
    model = make_model(list(zip(names, names[1:])), [names[-1]], pinned=pinned,
                       unrecomputable=stateful, size=size)
    reads = {b: (a,) for a, b in zip(names, names[1:])}
    return dataclasses.replace(model, grad_reads={names[0]: (), **reads}), names


def test_what_pinned_tensors_are_rebuilt_from_is_recomputed_even_in_the_tail():
    model, _ = chain_with_stateful_ops()
    problem = cuts.from_model(model)
    # t000..t013 rebuild t014, t016..t028 rebuild t029, t031..t043 rebuild t044.
    rerun = [i for i in range(60) if i < 14 or 15 < i < 29 or 30 < i < 44]
    assert list(np.flatnonzero(problem.op_rerun)) == rerun
    no_cut = cuts.evaluate(problem, [])
    assert no_cut.recompute == float(problem.op_cost[rerun].sum())
    after_last = cuts.evaluate(problem, [50])  # t050 kept; the tail t051.. is not rerun
    free = ~problem.always_kept[:50]
    assert after_last.recompute == float(problem.op_cost[:50][free].sum())


@pytest.mark.parametrize("share", [0.5, 0.7, 0.9])
def test_a_budget_above_the_least_peak_recomputes_less_than_memory(share):
    """Before the forced cuts, a budget of half of tf.gradients' memory and more
    returned the plan keeping only the pinned tensors (3,900-4,000 FLOPs
    recomputed), though keeping every other tensor fits half and recomputes
    2,600, keeping all of them fits tf.gradients' and recomputes nothing (in
    FLOPs of 100-byte tensors). Budgets count as a BFC allocator does, whose
    256-byte granule would make a 100-byte tensor 2.56 times its size: the
    tensors here are 1 MiB."""
    model, names = chain_with_stateful_ops(size=2**20)
    memory = strategies.memory(model)
    stock = pricing.allocator_baseline_bytes(model)  # budgets count as the allocator does

    def peak(result):
        return strategies.allocator_peak(model, result)

    chosen = msg.budget(share * stock)(model)
    assert peak(memory) < peak(chosen) <= share * stock
    assert chosen.recompute_flops < memory.recompute_flops
    spaced = [strategies.result_of(model, names[:-1:step], "every") for step in (1, 2, 3, 5)]
    fitting = [r.recompute_flops for r in spaced if peak(r) <= share * stock]
    assert fitting and chosen.recompute_flops <= min(fitting)


def test_budgets_recompute_less_as_they_grow_with_pinned_tensors():
    model, _ = chain_with_stateful_ops(size=2**20)  # 1 MiB tensors: see above
    least = budgets.least_feasible(model).estimate.allocator_peak_bytes
    stock = pricing.allocator_baseline_bytes(model)
    recomputes = [msg.budget(least + (stock - least) * k / 4)(model).recompute_flops
                  for k in range(5)]
    assert recomputes == sorted(recomputes, reverse=True)
    assert recomputes[-1] < recomputes[0] / 4


def test_a_budget_prices_the_tails_rerun_ops():
    """A problem built from arrays: ops 0-3 are rerun even in the tail, so
    with room for everything the no-cut plan (free before) is not the cheapest."""
    problem = cuts.make_problem([f"op{i}" for i in range(8)], [1] * 8, [1] * 8,
                                list(range(1, 8)) + [8], [False] * 8,
                                op_rerun=[True] * 4 + [False] * 4)
    assert cuts.evaluate(problem, []).recompute == 4
    found = solvers.least_recompute(problem, 100)
    assert found.cost.recompute == 0 and found.cost == cuts.evaluate(problem, found.cuts)
