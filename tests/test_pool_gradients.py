"""pool_gradients: XLA-compiled max pools differentiated without index buffers."""

import numpy as np
import pytest
import tensorflow as tf

from memory_saving_gradients.tfgraph import pool_gradients


@pytest.mark.parametrize("window, padding, pixels", [
    (2, "VALID", 8), (2, "SAME", 8), (3, "VALID", 10), ((2, 3), "VALID", 9)])
def test_first_max_gradient_equals_xlas_with_ties(window, padding, pixels):
    """Integer-valued inputs put several maxima in most windows: the gradient
    must go to the same (first, row-major) one as XLA's select-and-scatter,
    and nothing to the rows and columns a VALID pool does not read."""
    rng = np.random.default_rng(5)
    x = tf.constant(np.maximum(rng.integers(-2, 3, [2, pixels, pixels, 3]), 0), tf.float32)
    seed = tf.constant(rng.normal(size=[2, pixels, pixels, 3]), tf.float32)

    def step(ours):
        @tf.function(jit_compile=True)
        def gradient(x):
            pooled = tf.nn.max_pool2d(x * 1.0, window, window, padding)
            loss = tf.reduce_sum(pooled * seed[:, :pooled.shape[1], :pooled.shape[2], :])
            pools = [op for op in tf.compat.v1.get_default_graph().get_operations()
                     if op.type == "MaxPool"]
            assert all(pool_gradients.is_eligible(op) for op in pools) and pools
            if not ours:
                return tf.gradients(loss, x)[0]
            with pool_gradients.first_max_gradients(pools):
                return tf.gradients(loss, x)[0]
        return gradient(x)

    stock, ours = step(False), step(True)
    assert np.count_nonzero(stock.numpy()) > 0
    np.testing.assert_array_equal(ours.numpy(), stock.numpy())


def test_only_under_xla_and_tiling_windows():
    @tf.function
    def plain(x):
        pooled = tf.nn.max_pool2d(x, 2, 2, "VALID")
        return pool_gradients.is_eligible(pooled.op)

    @tf.function(jit_compile=True)
    def overlapping(x):
        pooled = tf.nn.max_pool2d(x, 3, 2, "VALID")
        return pool_gradients.is_eligible(pooled.op)

    x = tf.zeros([1, 8, 8, 1])
    assert not plain(x) and not overlapping(x)
