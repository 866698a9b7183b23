"""The budget solver against an exact MILP, and bad input to budgets and custom strategies.

No TensorFlow graphs: problems are built as arrays or as hand-made GraphModels.
scipy (HiGHS) is a test-only dependency, imported lazily.
"""

import itertools

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import memory_saving_gradients as msg
from memory_saving_gradients.core import cuts
from memory_saving_gradients.core import solvers
from memory_saving_gradients.core import strategies
from test_selection import chain_model


@st.composite
def problems(draw, max_ops=60):
    """Random DAGs in topological order: each op reads 1-2 recent ops, sometimes a far one."""
    n = draw(st.integers(2, max_ops))
    last = list(range(n))
    for i in range(1, n):
        reads = {draw(st.integers(max(0, i - 5), i - 1))}
        if draw(st.booleans()):
            reads.add(draw(st.integers(0, i - 1)))
        for r in reads:
            last[r] = max(last[r], i)
    last[-1] = n  # the y
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    costs = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    pinned = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    always = [p and draw(st.booleans()) for p in pinned]  # about a quarter
    return cuts.make_problem([f"op{i}" for i in range(n)], sizes, costs, last, always)


def milp_least_recompute(problem, budget):
    """The optimum of the cut model under `budget`, by an independent MILP (HiGHS).

    Variables: x_p (cut after op p), per free op y (kept), w (before the last
    cut), z (recomputed), and M (largest interval or tail). An interval (a, b]
    exists when a and b are cuts and nothing between is.
    """
    from scipy import optimize, sparse  # lazy: a test-only dependency

    n = len(problem.ops)
    positions = list(range(n - 1))
    free = [o for o in range(n) if not problem.always_kept[o]]
    nx = len(positions)
    index = {}
    for name in ("y", "w", "z"):
        for o in free:
            index[name, o] = nx + len(index)
    m_var = nx + len(index)
    rows, lower, upper = [], [], []

    def row(coefs, lo, hi):
        rows.append(coefs)
        lower.append(lo)
        upper.append(hi)

    size, last = problem.op_bytes, problem.last_use
    for o in free:
        alive = [p for p in positions if o <= p < last[o]]
        later = [p for p in positions if p >= o]
        for p in alive:
            row({index["y", o]: 1, p: -1}, 0, np.inf)
        row({index["y", o]: 1, **{p: -1 for p in alive}}, -np.inf, 0)
        for p in later:
            row({index["w", o]: 1, p: -1}, 0, np.inf)
        row({index["w", o]: 1, **{p: -1 for p in later}}, -np.inf, 0)
        row({index["z", o]: 1, index["w", o]: -1, index["y", o]: 1}, 0, np.inf)
    for a in [-1] + positions:
        tail = sum(size[o] for o in free if o > a)
        # tail * (x_a - sum of later cuts) <= M; the start (a = -1) is always a cut.
        coefs = {p: -tail for p in positions if p > a}
        if a >= 0:
            coefs[a] = tail
        row({**coefs, m_var: -1}, -np.inf, 0 if a >= 0 else -tail)
        for b in positions:
            if b <= a:
                continue
            inside = sum(size[o] for o in free if a < o <= b and last[o] <= b)
            coefs = {p: -inside for p in positions if a < p < b}
            coefs[b] = inside
            if a >= 0:
                coefs[a] = inside
            row({**coefs, m_var: -1}, -np.inf, inside * (1 if a >= 0 else 0))
    row({**{index["y", o]: size[o] for o in free}, m_var: 1}, -np.inf,
        budget - problem.fixed_bytes)
    matrix = sparse.lil_matrix((len(rows), m_var + 1))
    for r, coefs in enumerate(rows):
        for col, value in coefs.items():
            matrix[r, col] += value
    objective = np.zeros(m_var + 1)
    for o in free:
        objective[index["z", o]] = problem.op_cost[o]
    integrality = np.zeros(m_var + 1)
    integrality[:nx] = 1
    found = optimize.milp(objective, integrality=integrality,
                          bounds=optimize.Bounds(0, [1] * m_var + [np.inf]),
                          constraints=optimize.LinearConstraint(matrix.tocsr(), lower, upper))
    return found.fun if found.success else None


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(problem=problems(), share=st.floats(0, 1))
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


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(problem=problems(max_ops=11))
def test_least_peak_and_every_budget_match_brute_force(problem):
    every = [cuts.evaluate(problem, chosen)
             for k in range(len(problem.cuts) + 1)
             for chosen in itertools.combinations(problem.cuts, k)]
    least = min(c.peak_bytes for c in every)
    found = solvers.least_peak(problem).cost
    assert found.peak_bytes == least
    assert found.recompute == min(c.recompute for c in every if c.peak_bytes == least)
    assert solvers.least_recompute(problem, least - 1) is None
    for budget in range(least, problem.baseline_bytes + 1):
        fits = min(c.recompute for c in every if c.peak_bytes <= budget)
        assert solvers.least_recompute(problem, budget).cost.recompute == fits


def test_budget_below_the_smallest_feasible_names_it():
    model, _ = chain_model(64)
    smallest = strategies.memory(model).peak_bytes
    with pytest.raises(ValueError, match="smallest feasible budget") as raised:
        msg.budget(smallest - 1)(model)
    assert f"({smallest} bytes)" in str(raised.value)
    assert msg.budget(smallest)(model).peak_bytes <= smallest


def test_budgets_trade_memory_for_recompute_on_a_chain():
    model, _ = chain_model(64)
    results = [msg.budget(share * 64 * 100)(model) for share in (0.2, 0.5, 1.0)]
    for share, result in zip((0.2, 0.5, 1.0), results):
        assert result.peak_bytes <= share * 64 * 100 and result.feasible
    recomputes = [r.recompute_flops for r in results]
    assert recomputes == sorted(recomputes, reverse=True) and recomputes[-1] == 0


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
    assert set(result.chosen) == {names[2], names[5]}  # names[8] is the y
    assert result.estimate.peak_bytes < result.estimate.baseline_bytes
