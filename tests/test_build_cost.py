"""The rewrite's build work grows linearly with depth (design.md trap 9),
counted rather than timed: the tensors tf.gradients' walks reach, the scans
of a tf.function's captures, and the ops a gate makes (issue #15: the
256-block MLP's rewrite took 3x tf.gradients' time).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import func_graph

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import capture_lookup
from memory_saving_gradients.tfgraph import gradient_waits

WIDTH = 8


def _build_counts(monkeypatch, blocks):
    """(consumer lookups, capture scans, ops made) of one `gradients` call on
    a residual MLP of `blocks` blocks (two captured variables each), every
    block output a checkpoint: one level per block."""
    counts = {"lookups": 0, "scans": 0}
    lookup = capture_lookup._consumers

    def counted_lookup(tensor, func_graphs):
        counts["lookups"] += 1
        return lookup(tensor, func_graphs)

    monkeypatch.setattr(capture_lookup, "_consumers", counted_lookup)
    _count_capture_scans(monkeypatch, counts)
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.normal(0, 0.3, (WIDTH, WIDTH)).astype(np.float32))
               for _ in range(2 * blocks)]

    @tf.function(autograph=False)
    def step(x):
        h, kept = x, []
        for i in range(blocks):
            h = h + tf.matmul(tf.nn.relu(tf.matmul(h, weights[2 * i])), weights[2 * i + 1])
            kept.append(h)
        loss = tf.reduce_sum(h * h)
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        counts.update(lookups=0, scans=0)
        grads = msg.gradients(loss, weights, checkpoints=kept[:-1])
        counts["ops"] = len(graph.get_operations()) - before
        return grads

    step.get_concrete_function(tf.TensorSpec([4, WIDTH], tf.float32))
    return counts


def _count_capture_scans(monkeypatch, counts):
    """Counts walks over a FuncGraph's captures list (each list seen as one
    counting copy, so code that keeps the list sees the same object)."""
    stock = func_graph.FuncGraph.captures.fget
    copies = {}  # id(list) -> (list, its counting copy)

    class Counting(list):
        def __iter__(self):
            counts["scans"] += 1
            return super().__iter__()

    def captures(graph):
        pairs = stock(graph)
        if id(pairs) not in copies:
            copies[id(pairs)] = (pairs, Counting(pairs))
        return copies[id(pairs)][1]

    monkeypatch.setattr(func_graph.FuncGraph, "captures", property(captures))


def test_walks_and_ops_grow_linearly_with_the_number_of_levels(monkeypatch):
    # One level per block: a level whose tf.gradients call walked the whole
    # graph (no stubs) would make the lookups grow with depth squared.
    small, large = (_build_counts(monkeypatch, blocks) for blocks in (6, 12))
    assert large["lookups"] <= 2.3 * small["lookups"], (small, large)
    assert large["ops"] <= 2.3 * small["ops"], (small, large)


def test_captures_are_indexed_not_scanned_per_tensor_reached(monkeypatch):
    # tf.gradients' own lookup compares each tensor it reaches with every
    # capture of the function (24 variables here): one scan per lookup.
    counts = _build_counts(monkeypatch, 12)
    assert counts["lookups"] > 100, counts
    assert counts["scans"] <= 5, counts


def test_a_gate_makes_one_op_per_gradient_of_known_shape():
    @tf.function(autograph=False)
    def gated(x):
        gradients = [x * float(i) for i in range(20)] + [tf.reduce_sum(x, axis=0) * 2.0]
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        gate = gradient_waits.gate(gradients)
        made = len(graph.get_operations()) - before
        return gate, made

    gate, made = gated(tf.ones([3, 4]))
    assert not gate.numpy()
    assert made <= 21 + 10, made


@pytest.mark.parametrize("poison", [False, True])
def test_a_gate_reads_gradients_of_any_shape_and_kind(poison):
    # Rank 0, empty, unknown and partly known shapes, another dtype and
    # IndexedSlices; a NaN makes it True (it computes g != g).
    @tf.function(autograph=False, input_signature=[
        tf.TensorSpec(None, tf.float32), tf.TensorSpec([None, 3], tf.float32)])
    def gated(unknown, partly):
        scalar = tf.constant(np.nan if poison else 2.0)
        return gradient_waits.gate([
            scalar, tf.ones([4, 5]), tf.zeros([0, 5]), unknown, partly,
            tf.ones([3], tf.float16), tf.constant([1, 2]),
            tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]))])

    assert bool(gated(tf.ones([2, 2]), tf.zeros([0, 3]))) == poison
    assert bool(gated(tf.zeros([0]), tf.ones([2, 3]))) == poison
