"""pool_gradients: XLA-compiled max pools differentiated without index buffers."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from memory_saving_gradients.tfgraph import pool_gradients


def _xla_input_gradient(pool, x, ours):
    """d x of sum(pool(x) * seed) in a jit-compiled step: stock, or with our
    gradient for every max pool `pool` builds (all must be eligible)."""
    @tf.function(jit_compile=True)
    def gradient(x):
        pooled = pool(x)
        seed = tf.reshape(tf.range(1, 1 + tf.size(pooled), dtype=pooled.dtype) % 7 + 1,
                          tf.shape(pooled))
        loss = tf.reduce_sum(pooled * seed)
        pools = [op for op in tf.compat.v1.get_default_graph().get_operations()
                 if op.type == "MaxPool"]
        assert pools and all(pool_gradients.is_eligible(op) for op in pools)
        if not ours:
            return tf.gradients(loss, x)[0]
        with pool_gradients.first_max_gradients(pools):
            return tf.gradients(loss, x)[0]
    return gradient(x).numpy()


def _assert_as_stock(pool, x):
    stock = _xla_input_gradient(pool, x, ours=False)
    assert np.count_nonzero(stock) > 0
    np.testing.assert_array_equal(_xla_input_gradient(pool, x, ours=True), stock)


@pytest.mark.parametrize("window, padding, pixels", [
    (2, "VALID", 8), (2, "SAME", 8), (3, "VALID", 10), ((2, 3), "VALID", 9)])
def test_first_max_gradient_equals_xlas_with_ties(window, padding, pixels):
    """Integer-valued inputs put several maxima in most windows: the gradient
    must go to the same (first, row-major) one as XLA's select-and-scatter,
    and nothing to the rows and columns a VALID pool does not read."""
    rng = np.random.default_rng(5)
    x = tf.constant(np.maximum(rng.integers(-2, 3, [2, pixels, pixels, 3]), 0), tf.float32)
    _assert_as_stock(lambda x: tf.nn.max_pool2d(x * 1.0, window, window, padding), x)


def test_windows_with_nan_and_inf_pick_the_tap_xla_picks():
    """Every 2x2 window of {nan, 1, 2, -inf, inf}: a NaN is never 'greater or
    equal', so XLA's scan moves past or onto it; ours must move the same way."""
    values = [np.nan, 1.0, 2.0, -np.inf, np.inf]
    windows = np.array(list(itertools.product(values, repeat=4)), np.float32)
    x = tf.constant(windows.reshape(len(windows), 2, 2, 1))
    _assert_as_stock(lambda x: tf.nn.max_pool2d(x * 1.0, 2, 2, "VALID"), x)


def test_a_fused_producer_computed_twice_loses_no_window():
    """XLA computes x * w + b once for the pool and again where the gradient
    reads it, and may round the two differently: a gradient that looked for
    the element equal to the pooled maximum gave some windows nothing."""
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=[4, 32, 32, 3]), tf.float32)
    w = tf.constant(rng.normal(size=[3]), tf.float32)
    b = tf.constant(rng.normal(size=[3]), tf.float32)
    _assert_as_stock(lambda x: tf.nn.max_pool2d(x * w + b, 2, 2, "VALID"), x)


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
