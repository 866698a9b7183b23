"""GradientTape.gradient inside tf.function goes through our rewrite while checkpointing is on,
and gives exactly the stock tape's gradients (falling back to it where it cannot match:
test_tape_fallback.py)."""

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import compat
from tape_harness import X
from tape_harness import tanh_chain
from tape_harness import vs_stock


def test_persistent_tape_structures_output_gradients_unconnected(weights, caplog):
    w, u = weights
    unused = tf.Variable(1.0)

    def step(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            h = tanh_chain(x, w)
            y = tf.reduce_sum(h * u)
            total = tf.reduce_sum(h)
        first = tape.gradient(y, {"w": w, "u": u, "x": x}, output_gradients=tf.constant(2.0))
        second = tape.gradient([y, total], [w, (x, unused)],
                               unconnected_gradients="zero")
        return first, second

    vs_stock(step, [X], caplog)


def test_keras_variables_as_sources(caplog):
    import keras  # pylint: disable=import-outside-toplevel
    layer = keras.layers.Dense(8, activation="tanh")
    layer.build((None, 8))

    def step(x):
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(layer(layer(layer(layer(x)))))
        return tape.gradient(y, layer.trainable_weights)

    # A batch whose activations outweigh the weights, so the plan recomputes.
    vs_stock(step, [tf.random.stateless_normal([256, 8], seed=[3, 4])], caplog)


def test_unwatched_sources_get_what_the_tape_gives(weights, caplog):
    w, u = weights

    def step(x):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(w)
            y = tf.reduce_sum(tanh_chain(x, w) * u)
        return tape.gradient(y, [w, u, x], unconnected_gradients="zero")

    ours = vs_stock(step, [X], caplog)
    assert not ours[1].any() and not ours[2].any()  # u and x unwatched: zeros, as stock


def test_stop_recording_off_the_path_keeps_ours(weights, caplog):
    w, u = weights

    def step(x):
        with tf.GradientTape() as tape:
            h = tanh_chain(x, w)
            with tape.stop_recording():
                norm = tf.norm(w)
            y = tf.reduce_sum(h * u)
        return tape.gradient(y, [w, u]), norm

    vs_stock(step, [X], caplog)


def test_tf1_optimizer_follows_the_patch():
    module = compat.tf1_optimizer_gradients_module()
    original = module.gradients
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8])
        w = tf.compat.v1.get_variable("w", initializer=tf.random.stateless_normal([8, 8], [5, 6]))
        loss = tf.reduce_sum(tanh_chain(x, w))
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        with msg.checkpointing("memory"):
            ours = optimizer.compute_gradients(loss, [w])[0][0]
        assert module.gradients is original  # restored on leaving the block
        stock = optimizer.compute_gradients(loss, [w])[0][0]
        assert any("recompute_" in op.name for op in graph.get_operations())
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b = sess.run([stock, ours], {x: X.numpy()})
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_stop_gradient_inside_the_tape(weights, caplog):
    """tf.stop_gradient pauses every tape: what is made from its output is not tracked
    (stock gives None for it), and the rest is still checkpointed."""
    w, u = weights

    def step(x):
        with tf.GradientTape() as tape:
            h = tanh_chain(x, w, depth=2)
            stopped = tf.stop_gradient(h) * 2.0
            y = tf.reduce_sum(tanh_chain(h + stopped, w) * u)
        return tape.gradient(y, [w, u, stopped])

    ours = vs_stock(step, [X], caplog)
    assert ours[2] is None


def test_nested_function_call_on_the_path_keeps_ours(weights, caplog):
    # TensorFlow makes a nested call op with recording paused, then records it by hand.
    w, u = weights

    @tf.function
    def inner(h):
        return tf.tanh(h @ w) * 2.0

    def step(x):
        with tf.GradientTape() as tape:
            h = tanh_chain(inner(tanh_chain(x, w)), w)
            y = tf.reduce_sum(h * u)
        return tape.gradient(y, [w, u])

    vs_stock(step, [X], caplog)


def test_nested_function_call_under_stop_recording_falls_back(weights, caplog):
    w, u = weights

    @tf.function
    def inner(h):
        return tf.tanh(h @ w)

    def step(x):
        with tf.GradientTape() as tape:
            h = tanh_chain(x, w)
            with tape.stop_recording():
                h = inner(h)
            y = tf.reduce_sum(tanh_chain(h, w) * u)
        return tape.gradient(y, [w, u])

    vs_stock(step, [X], caplog, expect_ours=False)


def test_keras_grouped_convolution_call_keeps_ours(caplog):
    # Keras 3 runs a grouped Conv2D as an XLA-compiled function call (ConvNeXt).
    import keras  # pylint: disable=import-outside-toplevel
    grouped = keras.layers.Conv2D(8, 3, groups=8, padding="same")
    mixing = keras.layers.Conv2D(8, 1, activation="tanh")
    images = tf.random.stateless_normal([4, 8, 8, 8], seed=[5, 6])
    mixing(grouped(images))

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for _ in range(3):
                h = mixing(tf.tanh(grouped(h)))
            y = tf.reduce_sum(h * h)
        return tape.gradient(y, grouped.trainable_weights + mixing.trainable_weights)

    vs_stock(step, [images], caplog)
