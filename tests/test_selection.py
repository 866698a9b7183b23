"""Strategies, planning and simulation on hand-made models: no TensorFlow anywhere."""

import dataclasses
import logging

import networkx as nx
import pytest

from memory_saving_gradients.core import planning
from memory_saving_gradients.core import strategies
from memory_saving_gradients.core.model import Activation
from memory_saving_gradients.core.model import GraphModel
from random_models import random_model


def make_model(edges, ys, op_types=None, pinned=(), unrecomputable=(), size=100):
    """A GraphModel over single-output ops named by their tensors."""
    graph = nx.DiGraph()
    graph.add_edges_from(edges)
    op_types = op_types or {}
    tensors = {n: Activation(name=n, op=n, op_type=op_types.get(n, "Tanh"), bytes=size,
                             cost=size, recomputable=n not in unrecomputable, is_float=True)
               for n in graph}
    order = tuple(nx.lexicographical_topological_sort(graph))
    return GraphModel(
        graph=graph, tensors=tensors, order=order, pinned=frozenset(pinned), ys=tuple(ys),
        op_outputs={n: (n,) for n in graph}, num_region_ops=len(graph))


def chain_model(n):
    names = [f"t{i:03d}" for i in range(n)]
    return make_model(list(zip(names, names[1:])), [names[-1]]), names


def residual_model(n):
    """x_{k+1} = x_k + f(x_k): dominators are the x_k only."""
    edges = []
    for k in range(n):
        edges += [(f"x{k:03d}", f"f{k:03d}"), (f"x{k:03d}", f"x{k + 1:03d}"),
                  (f"f{k:03d}", f"x{k + 1:03d}")]
    return make_model(edges, [f"x{n:03d}"]), n


def test_memory_on_chain_keeps_about_sqrt_2n_with_shrinking_intervals():
    """Backprop frees each checkpoint once past it, so the intervals near the
    loss (differentiated while every earlier checkpoint is held) are shorter."""
    model, names = chain_model(100)
    chosen = strategies.memory(model).chosen
    assert 10 <= len(chosen) <= 16
    gaps = sorted(names.index(c) for c in chosen)
    spacing = [b - a for a, b in zip(gaps, gaps[1:])]
    assert spacing == sorted(spacing, reverse=True) and spacing[0] > spacing[-1] + 5


def test_memory_without_bottlenecks_halves_the_peak_and_warns_nothing(caplog):
    towers = []
    for tower in "abc":
        names = [f"{tower}{i:02d}" for i in range(30)]
        towers += list(zip(names, names[1:])) + [(names[-1], "y")]
    model = make_model(towers, ["y"])
    with caplog.at_level(logging.INFO):
        picked = strategies.run(model, "memory")
    assert picked.chosen and picked.notes
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "strategy memory keeps" in caplog.text
    assert picked.estimate.peak_bytes <= 0.5 * picked.estimate.baseline_bytes


def _weighted_chain(n, at):
    """`chain_model(n)` whose op at `at` (a share of the order) makes a weight
    gradient far larger than the activations: the held count then discounts
    every activation backprop holds before it is made."""
    from memory_saving_gradients.core import op_table
    model, _ = chain_model(n)
    ops = op_table.order(model)
    return dataclasses.replace(model, weight_grad_bytes={ops[int(len(ops) * at)]: 10**6})


def _both_counts(model, result):
    return tuple(strategies.counted_peak(model, result, count)
                 for count in (strategies.HELD, strategies.AS_TAKEN))


@pytest.mark.parametrize("make", [
    lambda: _weighted_chain(40, 0.3), lambda: _weighted_chain(60, 0.7),
    lambda: random_model(0, ops=30)], ids=["weighted chain 0.3", "weighted chain 0.7", "random0"])
def test_the_cheaper_plans_judge_passes_only_plans_at_no_more_memory_by_either_count(make):
    # `memory`'s search for a plan recomputing less than the least-peak one
    # (its effect on a real model: tests/test_memory_ranking.py).
    model = make()
    least = strategies.least_peak(model)
    judge = strategies._no_more_than(model, least, strategies.HELD, strategies.AS_TAKEN)
    bound = strategies.counted_peak(model, least, strategies.HELD)
    plans = strategies.staircase(model, strategies.cut_problem(model), bound * 2, "x")
    assert len(plans) > 1
    for plan in plans:
        within = all(a <= b for a, b in zip(_both_counts(model, plan), _both_counts(model, least)))
        assert (judge(plan) <= bound) == within


def test_speed_recomputes_only_cheap_ops_once_and_never_exceeds_tf_gradients():
    edges, types = [], {}
    for k in range(6):
        x, m, r, nxt = f"x{k}", f"m{k}", f"r{k}", f"x{k + 1}"
        edges += [(x, m), (m, r), (x, nxt), (r, nxt)]
        types[m] = "MatMul"
    model = make_model(edges, ["x6"], op_types=types)
    picked = strategies.speed(model)
    assert picked.estimate.peak_bytes < picked.estimate.baseline_bytes
    assert not any(n.startswith("r") for n in picked.chosen), "cheap relus are recomputed"
    plan = picked.plan
    copied = [op for level in plan.levels for op in level.copy_ops]
    assert len(copied) == len(set(copied)), "an op is recomputed twice"
    # A copied matmul may only be a level's own root: nothing reads its output,
    # so TensorFlow never runs it (its gradient needs only its inputs).
    for level in plan.levels:
        for op in level.copy_ops:
            assert not op.startswith("m") or op in level.checkpoints


def test_plan_levels_process_downstream_first_and_copy_segments():
    model, names = chain_model(7)
    plan = planning.make_plan(model, {names[2], names[4]}, "list")
    assert plan.kept == (names[2], names[4])
    assert [lvl.checkpoints for lvl in plan.levels] == [(names[2],), (names[4],)]
    assert plan.levels[1].copy_ops == (names[3], names[4])
    assert plan.levels[0].copy_ops == (names[0], names[1], names[2])


def test_unrecomputable_tensors_are_kept_and_reused():
    model = make_model([("a", "rand"), ("rand", "b"), ("b", "y")], ["y"],
                       pinned={"a", "rand"}, unrecomputable={"rand"})
    plan = planning.make_plan(model, set(), "list")
    assert set(plan.kept) == {"a", "rand"}
    assert all("rand" not in lvl.copy_ops for lvl in plan.levels)


def test_segment_of_root_fed_by_checkpoints_is_the_root_alone():
    model, names = chain_model(4)
    recomputed, reads = planning.segment(model, names[2], {names[1], names[2]})
    assert recomputed == {names[2]} and reads == {names[1]}


@pytest.mark.parametrize("n", [16, 64, 256])
def test_simulated_memory_shrinks_like_sqrt_n(n):
    model, _ = chain_model(n)
    est = strategies.memory(model).estimate
    # Every tanh output is kept (its gradient reads it), plus gradients in flight.
    assert n * 100 <= est.baseline_bytes <= (n + 2) * 100
    assert est.peak_bytes <= 2.5 * (n ** 0.5) * 100
    assert est.recompute_flops <= est.forward_flops


def test_explicit_names_outside_the_model_are_ignored_with_a_note():
    model, names = chain_model(6)
    result = strategies.explicit(model, [names[2], "weight:0"])
    assert result.chosen == (names[2],)
    assert any("weight:0" in note and "ignored" in note for note in result.notes)
    assert strategies.explicit(model, [names[2]]).notes == ()
