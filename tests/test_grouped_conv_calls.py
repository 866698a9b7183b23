"""Keras's XLA-compiled depthwise convolutions are differentiated by native
depthwise kernels during our tf.gradients calls (tfgraph/grouped_conv_calls.py).

Gradients equal stock tf.gradients'; XLA's dense K x K x C x C filter-gradient
temporary is gone from our step; other grouped convolutions, and variables
assigned between the forward pass and backprop, keep the stock gradient.
"""

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg

MIB = 2 ** 20


def _grouped_net():
    """Depthwise (stride 2, multiplier 2; 7x7 SAME), a 3x3 VALID depthwise and a
    two-group convolution (two input channels a group: not depthwise)."""
    return keras.Sequential([
        keras.Input((9, 9, 4)),
        keras.layers.Conv2D(8, 7, strides=2, padding="same", groups=4, activation="tanh"),
        keras.layers.Conv2D(8, 3, padding="valid", groups=8, activation="tanh"),
        keras.layers.Conv2D(4, 3, padding="same", groups=2),
    ])


def _steps(model, loss_of):
    """(stock, ours) tf.functions: the gradients of `loss_of(model, images)`."""
    def step(gradients):
        @tf.function
        def run(images):
            loss = loss_of(model, images)
            return gradients(loss, model.trainable_weights)
        return run
    return step(tf.gradients), step(lambda y, xs: msg.gradients(y, xs, checkpoints="memory"))


def _square_loss(model, images):
    return tf.reduce_sum(tf.square(model(images)))


def _op_types(step, images):
    return {op.type for op in step.get_concrete_function(images).graph.get_operations()}


def test_gradients_match_stock_with_native_depthwise_kernels():
    model = _grouped_net()
    images = tf.constant(np.random.default_rng(0).normal(size=(2, 9, 9, 4)), tf.float32)
    stock, ours = _steps(model, _square_loss)
    for expected, got in zip(stock(images), ours(images)):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
    ops = ours.get_concrete_function(images).graph.get_operations()
    assert [op.type for op in ops].count("DepthwiseConv2dNativeBackpropFilter") == 2
    backward_calls = [op for op in ops if op.type == "PartitionedCall" and "_grad" in op.name]
    assert len(backward_calls) == 1  # the two-group convolution's: XLA's, as stock
    assert "DepthwiseConv2dNativeBackpropFilter" not in _op_types(stock, images)


def test_xla_dense_filter_gradient_is_gone_from_our_step():
    """256 channels, 7x7: XLA's backward holds 2 x 7*7*256*256 floats (24.5 MiB)."""
    msg.enable_cpu_allocator_stats()
    model = keras.Sequential([keras.Input((4, 4, 256)),
                              keras.layers.Conv2D(256, 7, padding="same", groups=256)])
    images = tf.ones((2, 4, 4, 256))
    stock, ours = _steps(model, _square_loss)
    peaks = {}
    for name, step in (("stock", stock), ("ours", ours)):
        step(images)
        peaks[name] = msg.function_peak_bytes(step, images)[0]
    dense = 2 * 7 * 7 * 256 * 256 * 4
    assert peaks["stock"] > dense, peaks
    assert peaks["ours"] < 2 * MIB, peaks

    found = {}

    @tf.function
    def plan(images):
        loss = _square_loss(model, images)
        found["estimate"] = msg.checkpoint_plan(loss, model.trainable_weights, "memory").estimate
        return loss

    plan.get_concrete_function(images)  # traced only, to read the plan
    estimate = found["estimate"]
    assert dense < estimate.baseline_bytes < peaks["stock"] + MIB, estimate
    assert estimate.peak_bytes < 2 * MIB, estimate


def test_a_variable_assigned_before_backprop_keeps_the_stock_gradient():
    """Our gradient reads the filter again in backprop: not when it may have changed."""
    model = keras.Sequential([keras.Input((5, 5, 3)),
                              keras.layers.Conv2D(3, 3, padding="same", groups=3)])
    kernel = model.layers[0].kernel

    def loss_then_assign(model, images):
        loss = _square_loss(model, images)
        with tf.control_dependencies([loss]):
            kernel.assign_add(tf.ones_like(kernel))
        return loss

    images = tf.ones((1, 5, 5, 3))
    stock, ours = _steps(model, loss_then_assign)
    kernel.assign(tf.zeros_like(kernel) + 0.5)
    expected = stock(images)
    kernel.assign(tf.zeros_like(kernel) + 0.5)
    for want, got in zip(expected, ours(images)):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert "DepthwiseConv2dNativeBackpropFilter" not in _op_types(ours, images)


def test_unequal_strides_keep_the_stock_gradient():
    """The native depthwise kernels take only equal row and column strides
    (InvalidArgumentError otherwise): such a call keeps XLA's gradient."""
    model = keras.Sequential([
        keras.Input((9, 9, 4)),
        keras.layers.Conv2D(4, 3, strides=(1, 2), padding="same", groups=4, activation="tanh"),
        keras.layers.Conv2D(8, (3, 2), strides=(2, 1), padding="valid", groups=4),
    ])
    images = tf.constant(np.random.default_rng(1).normal(size=(2, 9, 9, 4)), tf.float32)
    stock, ours = _steps(model, _square_loss)
    for expected, got in zip(stock(images), ours(images)):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
    assert "DepthwiseConv2dNativeBackpropFilter" not in _op_types(ours, images)


def test_under_an_outer_jit_compile_the_dense_temporary_is_planned():
    """Inside a jit_compile step XLA compiles the native depthwise kernels too,
    with the same dense filter gradient (measured: 32.0 MiB for ours as for
    stock here): the call keeps its stock gradient and the plan counts it."""
    model = keras.Sequential([keras.Input((4, 4, 256)),
                              keras.layers.Conv2D(256, 7, padding="same", groups=256)])
    images = tf.ones((2, 4, 4, 256))
    found = {}

    @tf.function(jit_compile=True)
    def step(images):
        loss = _square_loss(model, images)
        found["estimate"] = msg.checkpoint_plan(loss, model.trainable_weights, "memory").estimate
        return msg.gradients(loss, model.trainable_weights, checkpoints="memory")

    types = {op.type for op in step.get_concrete_function(images).graph.get_operations()}
    assert "DepthwiseConv2dNativeBackpropFilter" not in types
    assert found["estimate"].peak_bytes > 2 * 7 * 7 * 256 * 256 * 4, found["estimate"]


def test_a_plain_nested_call_keeps_its_function_definition():
    # Asking a call's cached FunctionDef for a missing attr by [] inserted an
    # empty one: the call then failed at run time ("Failed to bind all placeholders").
    w = tf.Variable(tf.ones([4, 4]) * 0.1)

    @tf.function(autograph=False)
    def inner(x):
        return tf.tanh(x @ w)

    @tf.function(autograph=False)
    def step(x):
        y = tf.reduce_sum(tf.tanh(inner(tf.tanh(x))))
        return msg.gradients(y, [w], checkpoints="memory"), tf.gradients(y, [w])

    ours, stock = step(tf.ones([2, 4]))
    np.testing.assert_allclose(ours[0].numpy(), stock[0].numpy(), rtol=1e-6)
    definition = inner.get_concrete_function(tf.TensorSpec([2, 4])).function_def
    assert "_XlaMustCompile" not in definition.attr
