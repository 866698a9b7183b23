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


# name -> (function of a [3, 4] float32 tensor, whether its override is linear)
CASES = {
    "silu": (tf.nn.silu, True),
    "reversal": (_custom(lambda h, dy: -0.5 * dy), True),
    "straight_through": (_custom(lambda h, dy: tf.where(tf.abs(h) < 1.0, dy, tf.zeros_like(dy)),
                                 tf.round), True),
    "recompute_grad": (tf.recompute_grad(lambda h: tf.tanh(tf.matmul(h, tf.ones([4, 4])))), True),
    "clip": (_custom(lambda h, dy: tf.clip_by_value(dy, -0.2, 0.2)), False),
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
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3, 4])
        before = set(graph.get_operations())
        tf.sin(function(x))
        overridden = [op for op in graph.get_operations()
                      if op not in before and "_gradient_op_type" in op.node_def.attr]
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
