"""The forward pass's order: ops that free at least what they make run as soon as
they can (core/forward_order.py), so a branch Keras calls late is planned within
its layer."""

import random

import networkx as nx
import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from benchmarks.live_set_diff import allocator_events
from benchmarks.live_set_diff import requested_peak
from memory_saving_gradients.core.forward_order import freeing_ops_sooner


def _random_dag(seed, n=40):
    rng = random.Random(seed)
    names = [f"t{i}" for i in range(n)]
    graph = nx.DiGraph()
    graph.add_nodes_from(names)
    for i in range(1, n):
        for j in rng.sample(range(i), min(i, rng.choice((1, 1, 2, 3)))):
            graph.add_edge(names[j], names[i])
    sizes = {t: rng.choice((1, 2, 4)) for t in names}
    return names, graph, sizes


def _forward_peak(order, graph, sizes, ys):
    """Most bytes alive at once running `order`, each tensor freed after its last reader."""
    position = {t: i for i, t in enumerate(order)}
    end = len(order)
    live = np.zeros(end + 1)
    for t in order:
        last = end if t in ys else max([position[r] for r in graph.successors(t)],
                                        default=position[t])
        live[position[t]:last + 1] += sizes[t]
    return live.max()


@pytest.mark.parametrize("seed", range(60))
def test_the_order_is_topological_and_holds_at_most_one_tensor_more(seed):
    # A moved op frees at least what it makes from its new place to its old one,
    # but its own step (inputs and outputs alive together) may land beside more.
    names, graph, sizes = _random_dag(seed)
    ys = {names[-1]}
    order = freeing_ops_sooner(names, graph, {t: t for t in names}, sizes, ys)
    assert sorted(order) == sorted(names)
    position = {t: i for i, t in enumerate(order)}
    assert all(position[a] < position[b] for a, b in graph.edges)
    assert (_forward_peak(order, graph, sizes, ys)
            <= _forward_peak(names, graph, sizes, ys) + max(sizes.values()))


def test_moving_the_freeing_ops_lowers_the_peak_on_most_random_graphs():
    peaks = []
    for seed in range(60):
        names, graph, sizes = _random_dag(seed)
        order = freeing_ops_sooner(names, graph, {t: t for t in names}, sizes, {names[-1]})
        peaks.append(_forward_peak(order, graph, sizes, {names[-1]})
                     - _forward_peak(names, graph, sizes, {names[-1]}))
    assert sum(p < 0 for p in peaks) > 2 * sum(p > 0 for p in peaks), peaks


def test_an_op_freeing_less_than_it_makes_keeps_its_place():
    # b reads a and is a's last reader, but makes more than a: it is not moved up.
    graph = nx.DiGraph(["ac", "cd", "ab", "bd"])
    sizes = {"a": 1, "b": 2, "c": 1, "d": 1}
    assert freeing_ops_sooner("acbd", graph, {t: t for t in graph}, sizes) == tuple("acbd")


def test_an_op_waits_for_the_other_readers_of_what_it_frees():
    # s frees a, which c reads too: placed before c, it would not free a.
    graph = nx.DiGraph(["ab", "bc", "ac", "as", "cd"])
    sizes = dict.fromkeys(graph, 1)
    order = freeing_ops_sooner("abcds", graph, {t: t for t in graph}, sizes)
    assert order.index("s") > order.index("c")


def test_an_order_that_is_not_topological_is_refused():
    # b's op reads a tensor that is not in the order: it could never be placed.
    graph = nx.DiGraph([("a", "b"), ("elsewhere", "b")])
    with pytest.raises(ValueError, match="not a topological order"):
        freeing_ops_sooner("ab", graph, {"a": "A", "b": "B", "elsewhere": "E"},
                           dict.fromkeys("ab", 1))


def _wavenet(layers=8, width=256):
    """WaveNet's wiring on dense layers: gated layers on a residual path, each
    layer's skip projection feeding one sum of all the skips, which Keras calls
    after the whole residual path (it calls a functional model's layers by depth)."""
    import keras
    keras.utils.set_random_seed(1)
    inputs = keras.Input((width,))
    h = keras.layers.Dense(width)(inputs)
    skips = []
    for _ in range(layers):
        gate = keras.layers.Multiply()([keras.layers.Dense(width, activation="tanh")(h),
                                        keras.layers.Dense(width, activation="sigmoid")(h)])
        h = keras.layers.Add()([h, keras.layers.Dense(width)(gate)])
        skips.append(keras.layers.Dense(width)(gate))
    return keras.Model(inputs, keras.layers.ReLU()(keras.layers.Add()(skips)))


def _steps(model):
    def loss_of(x):
        return tf.reduce_mean(tf.square(model(x, training=True)))

    @tf.function
    def stock(x):
        return tf.gradients(loss_of(x), model.trainable_weights)

    @tf.function
    def ours(x):
        return msg.gradients(loss_of(x), model.trainable_weights, checkpoints="memory")
    return stock, ours


def test_a_side_branch_called_late_is_planned_within_its_layer():
    # Allocator peak less the weight gradients, "memory" / tf.gradients: 0.49 in
    # creation order (c683cbd: every gate kept for its skip projection), 0.21
    # with the freeing ops moved up. The benchmark's 12-layer dilated Conv1D
    # WaveNet: 0.57 / 0.57 -> 0.36 / 0.37, default / one thread (docs/planner.md,
    # session 77). Bytes requested (the profiler's): 0.195-0.209 in three runs
    # (session 79), where the allocator's peak, BFC's chunks, moved from 0.19
    # to 0.25 in one process and read 0.39 once in the full suite.
    model = _wavenet()
    x = tf.constant(np.random.default_rng(0).normal(size=(512, 256)), tf.float32)
    stock, ours = _steps(model)
    weights = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    expected, got = stock(x), ours(x)  # traced before the peaks are taken
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5 * np.abs(e).max())
    stock_peak = requested_peak(allocator_events(lambda inputs, _: stock(inputs), x, None))
    ours_peak = requested_peak(allocator_events(lambda inputs, _: ours(inputs), x, None))
    assert (ours_peak - weights) / (stock_peak - weights) <= 0.35, (ours_peak, stock_peak)
