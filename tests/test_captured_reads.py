"""Gradients that read the forward tensors they closed over (tf.custom_gradient).

A `tf.custom_gradient` function's gradient is a Python closure over the
tensors of the call that made it: differentiating a recomputed copy of its op
still builds gradient ops that read the *original* forward tensors
(`tf.nn.silu` recomputes its sigmoid from the original features), which kept
every such input alive from the forward pass to backprop. The rewrite now
points those reads at the level's copies (`captured_reads.py`).

Peaks are the allocation records of a traced Session run (bytes requested),
with 250,000-float tensors: 1 MB each.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg

UNIT = 250_000
MB = 1_000_000


def _silu_chain(depth):
    """x -> (x * w_i -> silu) * depth -> sum: every silu a tf.custom_gradient."""
    x = tf.compat.v1.placeholder(tf.float32, [UNIT])
    weights = [tf.Variable(1.0 + 0.01 * i, name=f"w{i}") for i in range(depth)]
    node = x
    for w in weights:
        node = tf.nn.silu(node * w)
    return x, weights, tf.reduce_sum(node)


def _peaks(depth):
    graph = tf.Graph()
    with graph.as_default():
        x, weights, y = _silu_chain(depth)
        stock = tf.gradients(y, weights)
        plan = msg.checkpoint_plan(y, weights, "memory")
        ours = msg.gradients(y, weights, checkpoints="memory")
        feed = {x: np.random.RandomState(0).randn(UNIT).astype(np.float32)}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            stock_peak, stock_val = msg.session_peak_bytes(sess, stock, feed)
            ours_peak, ours_val = msg.session_peak_bytes(sess, ours, feed)
    np.testing.assert_allclose(ours_val, stock_val, rtol=1e-5)
    return plan.estimate, stock_peak, ours_peak


def test_recomputed_custom_gradients_read_the_copies():
    estimate, stock, ours = _peaks(depth=16)
    # Before: each silu's copy read its original input, kept from the forward
    # pass, so the plan measured about what tf.gradients does.
    assert ours < 0.5 * stock, (ours, stock)
    assert estimate.peak_bytes == pytest.approx(ours, rel=0.15), (estimate.peak_bytes, ours)
