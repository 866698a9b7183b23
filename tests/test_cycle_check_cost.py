"""The no-cycle checks of the new control edges (gradient_waits.depends_on,
asked by product_order.sums_first and gradient_order's weight-gradient-first
swap) must not make the rewrite's build work grow with depth squared
(design.md trap 9): counted as the ops' edges they read, not timed."""

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import gradient_order
from memory_saving_gradients.tfgraph import product_order


def _edge_reads(monkeypatch, blocks):
    """Edge lists read inside depends_on during one `gradients` call on
    `blocks` conv + written-out batch norm blocks, every block's output a
    checkpoint (one level per block, as test_build_cost's MLP)."""
    counts = {"reads": 0, "inside": False}

    def counting(prop):
        def get(self):
            if counts["inside"]:
                counts["reads"] += 1
            return prop.fget(self)
        return property(get)

    for cls, name in ((tf.Operation, "inputs"), (tf.Operation, "control_inputs"),
                      (tf.Operation, "_control_outputs")):
        monkeypatch.setattr(cls, name, counting(getattr(cls, name)))
    consumers = ops.SymbolicTensor.consumers

    def counted_consumers(self):
        if counts["inside"]:
            counts["reads"] += 1
        return consumers(self)

    monkeypatch.setattr(ops.SymbolicTensor, "consumers", counted_consumers)
    for module in (product_order, gradient_order):
        stock = module.depends_on

        def wrapped(later, first, stock=stock):
            counts["inside"] = True
            try:
                return stock(later, first)
            finally:
                counts["inside"] = False

        monkeypatch.setattr(module, "depends_on", wrapped)
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.normal(0, 0.3, (3, 3, 4, 4)).astype(np.float32))
               for _ in range(blocks)]

    @tf.function(autograph=False)
    def step(x):
        h, kept = x, []
        for w in weights:
            y = tf.nn.conv2d(h, w, 1, "SAME")
            mean, variance = tf.nn.moments(y, [0, 1, 2])
            h = tf.tanh((y - mean) * tf.math.rsqrt(variance + 1e-3))
            kept.append(h)
        return msg.gradients(tf.reduce_sum(h * h), weights, checkpoints=kept[:-1])

    step.get_concrete_function(tf.TensorSpec([16, 6, 6, 4], tf.float32))
    return counts["reads"]


def test_no_cycle_checks_grow_linearly_with_depth(monkeypatch):
    small, large = (_edge_reads(monkeypatch, blocks) for blocks in (8, 16))
    assert small > 0
    assert large <= 2.5 * small, (small, large)
