"""Strategies, planning and simulation on hand-made models: no TensorFlow anywhere."""

import logging

import networkx as nx
import pytest

from memory_saving_gradients.core import planning
from memory_saving_gradients.core import simulation
from memory_saving_gradients.core import strategies
from memory_saving_gradients.core.model import Activation
from memory_saving_gradients.core.model import GraphModel


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


def test_bottlenecks_of_a_chain_are_its_interior():
    model, names = chain_model(6)
    assert strategies.bottlenecks(model) == names[:-1]


def test_bottlenecks_of_residual_chain_skip_the_branches():
    model, n = residual_model(5)
    found = strategies.bottlenecks(model)
    assert found == [f"x{k:03d}" for k in range(n)]


def test_no_bottleneck_in_parallel_paths():
    # Two independent towers joined only at the end (a U-Net without its middle).
    edges = [("a0", "a1"), ("a1", "a2"), ("b0", "b1"), ("b1", "b2"),
             ("a2", "y"), ("b2", "y")]
    model = make_model(edges, ["y"])
    assert strategies.bottlenecks(model) == []


def test_memory_on_chain_keeps_about_sqrt_n_evenly_spaced():
    model, names = chain_model(100)
    chosen = strategies.memory(model).names
    assert 6 <= len(chosen) <= 16
    gaps = sorted(names.index(c) for c in chosen)
    spacing = [b - a for a, b in zip(gaps, gaps[1:])]
    assert max(spacing) - min(spacing) <= 3


def test_memory_falls_back_to_separators_and_warns(caplog):
    towers = []
    for tower in "abc":
        names = [f"{tower}{i:02d}" for i in range(30)]
        towers += list(zip(names, names[1:])) + [(names[-1], "y")]
    model = make_model(towers, ["y"])
    with caplog.at_level(logging.WARNING):
        picked = strategies.memory(model)
    assert picked.names and picked.notes
    assert "no usable single-tensor bottleneck" in caplog.text
    plan = planning.make_plan(model, picked.names, "memory")
    est = simulation.estimate(model, plan)
    assert est.peak_bytes <= 0.5 * est.baseline_bytes


def test_speed_keeps_expensive_outputs_and_bounds_residual_streams():
    edges, types = [], {}
    for k in range(6):
        x, m, r, nxt = f"x{k}", f"m{k}", f"r{k}", f"x{k + 1}"
        edges += [(x, m), (m, r), (x, nxt), (r, nxt)]
        types[m] = "MatMul"
    model = make_model(edges, ["x6"], op_types=types)
    chosen = strategies.speed(model).names
    assert {f"m{k}" for k in range(6)} <= chosen
    assert not any(n.startswith("r") for n in chosen), "cheap relus should be recomputed"
    plan = planning.make_plan(model, chosen, "speed")
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
    plan = planning.make_plan(model, strategies.memory(model).names, "memory")
    est = simulation.estimate(model, plan)
    assert est.baseline_bytes == n * 100
    assert est.peak_bytes <= 2.5 * (n ** 0.5) * 100
    assert est.recompute_flops <= est.forward_flops
