"""Which gradient overrides count as linear in the incoming gradient
(`gradient_linearity`), and that only the others are kept from recomputation."""

import pytest
import tensorflow as tf

from memory_saving_gradients.tfgraph import gradient_reads
from memory_saving_gradients.tfgraph import reading


def _custom(gradient, forward=tf.identity):
    """A tf.custom_gradient of `forward` whose gradient is `gradient(h, dy)`."""
    @tf.custom_gradient
    def apply(h):
        return forward(h), lambda dy: gradient(h, dy)
    return apply


@tf.RegisterGradient("MsgTestSignOfGradient")
def _sign_of_gradient(op, dy):
    del op
    return tf.sign(dy)


_FILTER = tf.Variable(tf.ones([1, 1, 4, 4]) * 0.1)  # made eagerly: its handle is an eager capture


def _conv_batch_norm(h):
    image = tf.nn.conv2d(tf.reshape(h, [1, 3, 4, 1]) * tf.ones([1, 1, 1, 4]), _FILTER, 1, "SAME")
    normed, _, _ = tf.compat.v1.nn.fused_batch_norm(image, tf.ones([4]), tf.zeros([4]))
    return tf.reshape(tf.reduce_mean(tf.nn.relu(normed), axis=3), [3, 4])


def _unused_second_output(h):
    return tf.recompute_grad(lambda t: (tf.tanh(t), tf.transpose(tf.sin(t))))(h)[0]


# name -> (function of a [3, 4] float32 tensor, whether its override is linear)
CASES = {
    "silu": (tf.nn.silu, True),
    "reversal": (_custom(lambda h, dy: -0.5 * dy), True),
    "straight_through": (_custom(lambda h, dy: tf.where(tf.abs(h) < 1.0, dy, tf.zeros_like(dy)),
                                 tf.round), True),
    "recompute_grad": (tf.recompute_grad(lambda h: tf.tanh(tf.matmul(h, tf.ones([4, 4])))), True),
    "recompute_grad_conv_batch_norm": (tf.recompute_grad(_conv_batch_norm), True),
    "recompute_grad_unused_output": (_unused_second_output, True),
    "doubled_in_float64": (_custom(lambda h, dy: tf.cast(tf.cast(dy, tf.float64) * 2.0,
                                                         tf.float32)), False),  # rounds back
    "clip": (_custom(lambda h, dy: tf.clip_by_value(dy, -0.2, 0.2)), False),
    "bfloat16_compressed": (_custom(lambda h, dy: tf.cast(tf.cast(dy, tf.bfloat16), dy.dtype)),
                            False),
    "scaled_by_a_count": (_custom(lambda h, dy: dy * tf.cast(
        tf.size(tf.boolean_mask(dy, dy > 0)), dy.dtype)), False),
    "relu_through_a_nan_test": (_custom(lambda h, dy: tf.where(
        tf.math.is_nan(tf.sqrt(dy)), tf.zeros_like(dy), dy)), False),
    "bfloat16_round_trip_in_float16": (lambda x: tf.cast(_custom(
        lambda h, dy: tf.cast(tf.cast(dy, tf.bfloat16), dy.dtype))(tf.cast(x, tf.float16)),
        tf.float32), False),
    "bias_through_identity_n": (_custom(lambda h, dy: tf.add_n(
        tf.identity_n([dy, 0.1 * tf.sign(h)]))), False),
    "normalized": (_custom(lambda h, dy: dy / tf.norm(dy)), False),
    "constant": (_custom(lambda h, dy: tf.ones_like(h)), False),
    "affine": (_custom(lambda h, dy: dy + 1.0), False),
    "squared": (_custom(lambda h, dy: dy * dy), False),
    "where_not_zero": (_custom(lambda h, dy: tf.where(h > 0, dy, tf.ones_like(dy))), False),
}


def _override_map(h):
    with tf.compat.v1.get_default_graph().gradient_override_map(
            {"Identity": "MsgTestSignOfGradient"}):
        return tf.identity(h)


@pytest.mark.parametrize("name", sorted(CASES))
def test_overrides_linear_in_the_incoming_gradient_are_told_apart(name):
    function, linear = CASES[name]
    graph = tf.function(lambda x: tf.sin(function(x))).get_concrete_function(
        tf.TensorSpec([3, 4])).graph
    overridden = [op for op in graph.get_operations() if "_gradient_op_type" in op.node_def.attr]
    assert overridden
    assert [gradient_reads.gradient_reads(op).linear for op in overridden] == [linear] * len(
        overridden)


def test_a_gradient_override_map_is_checked_like_a_custom_gradient():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3, 4])
        overridden = _override_map(x).op
        plain = tf.identity(x).op
    assert not gradient_reads.gradient_reads(overridden).linear
    assert gradient_reads.gradient_reads(plain).linear


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("linear", [True, False])
def test_a_function_call_is_as_linear_as_the_overrides_it_runs(linear, nested):
    inner = tf.function(CASES["reversal" if linear else "clip"][0], autograph=False)
    inner = inner if nested else inner.python_function

    @tf.function(autograph=False)
    def called(h):
        return tf.tanh(inner(h)) * 2.0

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3, 4])
        call = called(tf.sin(x)).op
    assert call.type in ("PartitionedCall", "StatefulPartitionedCall")
    assert gradient_reads.gradient_reads(call).linear == linear


@pytest.mark.parametrize("name", ["silu", "clip"])
def test_only_ops_with_a_nonlinear_gradient_are_kept_from_recomputation(name):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3, 4])
        w = tf.Variable(tf.ones([4, 4]))
        h = CASES[name][0](tf.tanh(tf.matmul(x, w)))
        y = tf.reduce_sum(tf.sin(tf.matmul(h, w)))
        model = reading.build_model([y], [x]).model
    overridden = [t for t in model.tensors.values() if t.op_type == "IdentityN"]
    assert overridden
    assert all(t.recomputable == CASES[name][1] for t in overridden)


@tf.custom_gradient
def _scale_by(h, v):
    def gradient(dy):  # linear in dy for h, clipped for v
        return dy * v, tf.clip_by_value(tf.reduce_sum(dy * h, 0), -0.05, 0.05)
    return h * v, gradient


def test_linearity_covers_inputs_the_first_order_does_not_differentiate():
    """A second order may differentiate v, which a first order with respect to
    h alone prunes from the gradient's ops."""
    graph = tf.Graph()
    with graph.as_default():
        h = tf.compat.v1.placeholder(tf.float32, [3, 4])
        v = tf.compat.v1.placeholder(tf.float32, [4])
        op = tf.sin(_scale_by(h, v)).op.inputs[0].op
    assert op.type == "IdentityN"
    wanted = [t is h for t in op.inputs]
    assert not gradient_reads.gradient_reads(op, wanted).linear


@pytest.mark.parametrize("body", ["silu", "clip"])
def test_the_layer_decorators_own_gradient_is_as_linear_as_its_body(body):
    """Its gradient calls our gradients on the layer's graph, which no probe can
    build elsewhere: it is declared linear where the body's overrides are, and
    a body holding one that is not linear builds plainly, with no boundary."""
    import keras
    from memory_saving_gradients.keras import recompute_grad

    class Decorated(keras.layers.Layer):
        def build(self, shape):
            self.dense = keras.layers.Dense(4, activation="tanh")

        @recompute_grad
        def call(self, inputs):
            return CASES[body][0](self.dense(inputs) * 2.0)

    layer = Decorated()

    @tf.function
    def step(x):
        return tf.sin(layer(x))

    import memory_saving_gradients as msg
    with msg.checkpointing():
        graph = step.get_concrete_function(tf.TensorSpec([3, 4])).graph
    overridden = [op for op in graph.get_operations() if "_gradient_op_type" in op.node_def.attr]
    if not CASES[body][1]:
        assert len(overridden) == 1  # the body's own clip
        assert not gradient_reads.gradient_reads(overridden[0]).linear
        return
    *inner, segment = overridden  # the segment's comes last
    assert inner and segment.inputs[0].op.name.startswith(inner[-1].name)
    assert gradient_reads.gradient_reads(segment).linear


@pytest.mark.parametrize("name", ["reversal", "clip"])
def test_a_loop_is_as_linear_as_the_overrides_in_its_body(name):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3, 4])
        tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, CASES[name][0](tf.sin(h))),
                      [0, x])
    (loop,) = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert gradient_reads.gradient_reads(loop).linear == CASES[name][1]
