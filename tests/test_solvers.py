"""The budget solver against an exact MILP, and bad input to budgets and custom strategies.

No TensorFlow graphs: problems are built as arrays or as hand-made GraphModels.
scipy (HiGHS) is a test-only dependency, imported lazily.
"""

import dataclasses
import itertools

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import memory_saving_gradients as msg
from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import cuts
from memory_saving_gradients.core import pricing
from memory_saving_gradients.core import solvers
from memory_saving_gradients.core import strategies
from test_selection import chain_model
from test_selection import residual_model


@st.composite
def problems(draw, max_ops=60, weights=False, scale=1, weight_scale=1):
    """Random DAGs in topological order: each op reads 1-2 recent ops, sometimes a far one;
    with `weights`, in about half the problems, ops' gradients also send bytes to weights;
    in about half, some ops are rerun even in the tail (pinned tensors are rebuilt from them).
    Sizes are 1-4 times `scale` bytes, weight gradients 0-3 times `weight_scale`."""
    n = draw(st.integers(2, max_ops))
    last = list(range(n))
    for i in range(1, n):
        reads = {draw(st.integers(max(0, i - 5), i - 1))}
        if draw(st.booleans()):
            reads.add(draw(st.integers(0, i - 1)))
        for r in reads:
            last[r] = max(last[r], i)
    last[-1] = n  # the y
    sizes = [scale * s for s in draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))]
    costs = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    pinned = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    always = [p and draw(st.booleans()) for p in pinned]  # about a quarter
    held = [draw(st.integers(0, size)) for size in sizes]  # what gradients read
    sent = ([weight_scale * w for w in draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))]
            if weights and draw(st.booleans()) else None)
    rerun = (draw(st.lists(st.booleans(), min_size=n, max_size=n))
             if draw(st.booleans()) else None)
    return cuts.make_problem([f"op{i}" for i in range(n)], sizes, costs, last, always,
                             op_held=held, op_weights=sent, op_rerun=rerun)


def _interval(problem, a, b):
    """(kept bytes, recomputed held bytes, recomputed cost) of the interval (a, b],
    by definition; as a tail (b: the last op), (0, held bytes, 0)."""
    kept = size = cost = 0
    tail = b == len(problem.ops) - 1
    for o in range(a + 1, b + 1):
        if problem.always_kept[o]:
            continue
        if problem.last_use[o] > b and not tail:
            kept += problem.op_bytes[o]
        else:
            size += problem.op_held[o]
            cost += problem.op_cost[o]
    return kept, size, 0 if tail else cost


def milp_least_recompute(problem, budget):
    """The optimum of the cut model under `budget`, by an exact MILP (HiGHS).

    A plan is a unit flow from the start through chosen cuts into the tail:
    e[a, b] = 1 when (a, b] is an interval, t[a] = 1 when a is the last cut.
    A second flow carries the bytes held: y[a, b] what is held entering
    (a, b], z[a] entering the tail; each chosen interval (or the tail) fits
    with what it enters holding, and an unchosen one carries nothing. A tail
    costs the recompute of its ops that are rerun (`op_rerun`).
    """
    from scipy import optimize, sparse  # lazy: a test-only dependency

    n = len(problem.ops)
    room = budget - problem.fixed_bytes
    starts = list(range(-1, n - 1))
    edges = [(a, b) for a in starts for b in range(a + 1, n - 1)]
    values = [_interval(problem, a, b) for a, b in edges]
    tails = [_interval(problem, a, n - 1)[1] for a in starts]
    t_col, y_col = len(edges), len(edges) + len(starts)
    z_col = y_col + len(edges)
    entries, bounds = [], []  # (row, column, value), (low, high) per row

    def row(terms, low, high):
        entries.extend((len(bounds), col, value) for col, value in terms)
        bounds.append((low, high))

    for p in starts:
        out = [col for col, (a, _) in enumerate(edges) if a == p]
        into = [col for col, (_, b) in enumerate(edges) if b == p]
        start = 1 if p == -1 else 0
        row([(c, 1) for c in out] + [(c, -1) for c in into] + [(t_col + p + 1, 1)],
            start, start)
        row([(y_col + c, 1) for c in out] + [(z_col + p + 1, 1)]
            + [(y_col + c, -1) for c in into] + [(c, -values[c][0]) for c in into], 0, 0)
    for col, (kept, size, _) in enumerate(values):
        row([(y_col + col, 1), (col, kept + size - room)], -np.inf, 0)
    for p, size in zip(starts, tails):
        row([(z_col + p + 1, 1), (t_col + p + 1, size - room)], -np.inf, 0)
    rows, cols, vals = zip(*entries)
    columns = z_col + len(starts)
    matrix = sparse.csr_matrix((vals, (rows, cols)), shape=(len(bounds), columns))
    objective = np.zeros(columns)
    objective[:len(edges)] = [cost for _, _, cost in values]
    rerun = np.where(problem.op_rerun, problem.op_cost, 0)
    objective[t_col:y_col] = [rerun[p + 1:].sum() for p in starts]
    integrality = np.zeros(columns)
    integrality[:y_col] = 1
    low, high = zip(*bounds)
    problem_args = dict(
        integrality=integrality,
        bounds=optimize.Bounds(0, [1] * y_col + [np.inf] * (columns - y_col)),
        constraints=optimize.LinearConstraint(matrix, low, high))
    found = optimize.milp(objective, **problem_args)
    if not found.success:
        # HiGHS's presolve called a feasible 4-op problem infeasible (scipy
        # 1.17.1: no cut fits the budget exactly; solved without it, 0).
        found = optimize.milp(objective, options={"presolve": False}, **problem_args)
    return found.fun if found.success else None


@pytest.mark.slow  # HiGHS on up to 60 ops, 12 examples: about 1-4 minutes on 2 shared cores
@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(problem=problems(), share=st.floats(0, 1))
@hypothesis.example(  # HiGHS's presolve called it infeasible (a CI run, session 44)
    problem=cuts.make_problem([f"op{i}" for i in range(4)], [2, 1, 1, 1], [1, 1, 1, 1],
                              [3, 1, 2, 4], [False] * 4, op_held=[0, 0, 1, 1]),
    share=0.0)
def test_budgeted_recompute_matches_the_milp_optimum(problem, share):
    pytest.importorskip("scipy")
    least = solvers.least_peak(problem).cost.peak_bytes
    budget = least + share * (problem.baseline_bytes - least)
    found = solvers.least_recompute(problem, budget)
    optimum = milp_least_recompute(problem, budget)
    assert optimum is not None, "the least-peak plan fits, so the MILP is feasible"
    assert found is not None
    assert found.cost.peak_bytes <= budget
    assert found.cost == cuts.evaluate(problem, found.cuts)
    assert found.cost.recompute <= optimum * 1.01 + 1e-6


def _every_plan(problem):
    """The cut-model cost of every subset of the candidate cuts (brute force)."""
    return [cuts.evaluate(problem, chosen)
            for k in range(len(problem.cuts) + 1)
            for chosen in itertools.combinations(problem.cuts, k)]


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(problem=problems(max_ops=11, weights=True))
def test_least_peak_and_every_budget_match_brute_force(problem):
    every = _every_plan(problem)
    least = min(c.peak_bytes for c in every)
    found = solvers.least_peak(problem).cost
    assert found.peak_bytes == least
    assert found.recompute == min(c.recompute for c in every if c.peak_bytes == least)
    assert solvers.least_recompute(problem, least - 1) is None
    for budget in range(least, problem.baseline_bytes + 1):
        fits = min(c.recompute for c in every if c.peak_bytes <= budget)
        assert solvers.least_recompute(problem, budget).cost.recompute == fits


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(problem=problems(max_ops=11, weights=True, scale=1000, weight_scale=20000),
                  share=st.floats(0, 1))
def test_budgets_in_quanta_fit_when_weight_gradients_outweigh_the_room(problem, share):
    """Kept bytes in quanta of more than a byte, and weight gradients many times the
    room (running kept totals far below zero, past the NEGATIVE_QUANTA floor): the
    plan found fits its budget, and the search in 1-byte quanta is brute force's."""
    every = _every_plan(problem)
    least = min(c.peak_bytes for c in every)
    assert solvers.least_peak(problem).cost.peak_bytes == least
    budget = least + share * (problem.baseline_bytes - least)
    found = solvers.least_recompute(problem, budget)
    if found is not None:
        assert found.cost == cuts.evaluate(problem, found.cuts)
        assert found.cost.peak_bytes <= budget
    exact = solvers.least_recompute(problem, budget, quanta=2**40)
    assert exact.cost.recompute == min(c.recompute for c in every if c.peak_bytes <= budget)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(problem=problems(max_ops=30, weights=True))
def test_low_peak_plans_start_with_the_least_peak_and_rise(problem):
    plans = solvers.low_peak_plans(problem, count=5)
    assert len({p.cuts for p in plans}) == len(plans) <= 5
    peaks = [p.cost.peak_bytes for p in plans]
    assert peaks == sorted(peaks)
    assert all(p.cost == cuts.evaluate(problem, p.cuts) for p in plans)


def test_least_peak_takes_the_least_predicted_peak_of_the_candidates():
    model, _ = chain_model(40)
    chosen = strategies.least_peak(model)
    for found in solvers.low_peak_plans(strategies.cut_problem(model),
                                        count=strategies.CANDIDATE_PLANS):
        names = strategies.tensors_of(model, found.cost.kept_ops)
        assert chosen.peak_bytes <= strategies.result_of(model, names, "x").peak_bytes


@pytest.mark.parametrize("n", [40, 100])
def test_memory_keeps_the_least_peak_and_recomputes_no_more(n):
    model, _ = residual_model(n)
    least, chosen = strategies.least_peak(model), strategies.memory(model)
    assert chosen.peak_bytes <= least.peak_bytes
    assert chosen.recompute_flops <= least.recompute_flops


def test_budget_below_the_smallest_feasible_names_it():
    model, _ = chain_model(64)
    # As a BFC allocator counts it, what budgets are judged by.
    smallest = budgets.least_feasible(model).estimate.allocator_peak_bytes
    with pytest.raises(ValueError, match="smallest feasible budget") as raised:
        msg.budget(smallest - 1)(model)
    assert f"({smallest} bytes)" in str(raised.value)
    assert msg.budget(smallest)(model).estimate.allocator_peak_bytes <= smallest


def test_budgets_trade_memory_for_recompute_on_a_chain():
    model, _ = chain_model(64)
    stock = pricing.allocator_baseline_bytes(model)  # what tf.gradients keeps, in chunks
    results = [msg.budget(share * stock)(model) for share in (0.3, 0.5, 1.0)]
    for share, result in zip((0.3, 0.5, 1.0), results):
        assert result.estimate.allocator_peak_bytes <= share * stock and result.feasible
    recomputes = [r.recompute_flops for r in results]
    assert recomputes == sorted(recomputes, reverse=True) and recomputes[-1] == 0


def _below_stock(model):
    """A budget just under tf.gradients' peak (at or above it needs no plan)."""
    return msg.budget(strategies.stock(model, "stock").peak_bytes - 1)(model)


@pytest.mark.parametrize("strategy", [strategies.memory, _below_stock, msg.memory_within(0.1)],
                         ids=["memory", "budget", "memory_within"])
def test_strategies_build_the_cut_problem_once(strategy, monkeypatch):
    model, _ = chain_model(32)
    built, build = [], strategies.cut_problem

    def counted(graph_model):
        built.append(graph_model)
        return build(graph_model)

    monkeypatch.setattr(strategies, "cut_problem", counted)
    strategy(model)
    assert len(built) == 1


@pytest.mark.parametrize("value, error, words", [
    (-1, ValueError, "positive, finite number of bytes"),
    (0, ValueError, "positive, finite number of bytes"),
    (float("nan"), ValueError, "positive, finite"),
    ("2GB", TypeError, "takes a number of bytes, got str"),
    (True, TypeError, "takes a number of bytes, got bool"),
    (None, TypeError, "got NoneType"),
])
def test_bad_budgets_fail_at_construction(value, error, words):
    with pytest.raises(error, match=words):
        msg.budget(value)


@pytest.mark.parametrize("returned, error, words", [
    (None, TypeError, "must return a list of tensor names"),
    ("t003", TypeError, "must return a list of tensor names"),
    ([3], TypeError, "return tensor names"),
    (["t003", "no_such_tensor:0"], ValueError, r"not activations.*no_such_tensor:0"),
])
def test_custom_strategy_returning_other_than_tensor_names_is_an_error(returned, error,
                                                                       words):
    model, _ = chain_model(8)

    def keep_odd(graph_model):
        return returned

    with pytest.raises(error, match=words):
        strategies.run(model, keep_odd)


def test_custom_strategy_keeps_what_it_returns():
    model, names = chain_model(9)

    def every_third(graph_model):
        return [n for i, n in enumerate(graph_model.order) if i % 3 == 2]

    result = strategies.run(model, every_third)
    assert result.strategy == "custom:every_third"
    assert set(result.chosen) == {names[2], names[5], names[8]}
    assert result.estimate.peak_bytes < result.estimate.baseline_bytes


def test_memory_prices_the_weight_gradients_alive_late_in_backprop():
    """Weight gradients live from their gradient op to the end of the step: the
    intervals differentiated last share the peak with nearly all of them, the
    first with few, so the least-peak plan keeps more than sqrt(2n) tensors
    (the 256-block MLP: 22 kept, 14.7 MiB predicted, where 63 evenly spaced
    were predicted at 5.4). The cut model counts them as the timeline does."""
    model, names = residual_model(120)
    model = dataclasses.replace(model, weight_grad_bytes={n: 150 for n in model.order
                                                          if n.startswith("f")})
    chosen = strategies.memory(model)
    spaced = [strategies.result_of(model, [f"x{k:03d}" for k in range(step, 120, step)], "x")
              for step in (2, 3, 4, 6, 8, 12)]
    assert chosen.peak_bytes <= min(r.peak_bytes for r in spaced)


def test_an_intervals_own_weight_gradients_count_beside_its_recompute():
    """An interval's weight gradients are made while it is differentiated, not
    before: beside its recomputed tensors they still count. Counted as already
    made, heavy weights late in the network (ResNet50's 2048-channel
    convolutions) made every late interval look free, and 'memory' chose a plan
    the timeline prices worse than the weight-blind one (ResNet50: 27.0 MiB
    predicted against 19.9; now 18.2)."""
    model, _ = residual_model(120)
    heavy = {n: (2000 if int(n[1:]) >= 90 else 20) for n in model.order if n.startswith("f")}
    weighted = dataclasses.replace(model, weight_grad_bytes=heavy)
    blind = strategies.memory(model)  # the same graph, no weight gradients in the plan
    blind_on_weighted = strategies.result_of(weighted, blind.chosen, "blind")
    assert strategies.memory(weighted).peak_bytes <= blind_on_weighted.peak_bytes
