"""gradient_paths: where tf.gradients would meet an op without a registered gradient."""

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat, gradient_paths


def _ops_of_type(function, op_type):
    graph = tf.function(function).get_concrete_function(tf.TensorSpec([4], tf.float32)).graph
    return [op for op in graph.get_operations() if op.type == op_type]


def _in_cond(inner):
    return lambda x: tf.cond(tf.reduce_sum(x) > 0.0, lambda: inner(x), lambda: x)


def test_an_op_without_gradient_is_found_inside_a_cond_a_loop_and_a_call():
    (cond,) = _ops_of_type(_in_cond(lambda t: tf.truncatemod(t, 0.7)), "StatelessIf")
    (loop,) = _ops_of_type(lambda x: tf.while_loop(
        lambda i, v: i < 2, lambda i, v: (i + 1, tf.truncatemod(v, 0.7)), (0, x))[1],
        "StatelessWhile")
    (call,) = _ops_of_type(lambda x: tf.function(lambda t: tf.truncatemod(t, 0.7))(x),
                           "PartitionedCall")
    (nested,) = _ops_of_type(_in_cond(_in_cond(lambda t: tf.truncatemod(t, 0.7))),
                             "StatelessIf")
    for holder in (cond, loop, call, nested):
        assert gradient_paths.gradient_missing_at(holder) == "TruncateMod", holder.type


def test_an_op_without_gradient_no_gradient_reaches_is_not_found():
    # tf.floor's gradient is None, a stop passes none, and an op reading
    # only an integer is no path from an argument: TensorFlow differentiates
    # each of these conds without raising.
    for inner in (lambda t: tf.floor(tf.truncatemod(t, 0.7)) + t,
                  lambda t: tf.stop_gradient(tf.truncatemod(t, 0.7)) + t,
                  lambda t: tf.cast(tf.truncatemod(tf.shape(t), 3), tf.float32) * t):
        (cond,) = _ops_of_type(_in_cond(inner), "StatelessIf")
        assert gradient_paths.gradient_missing_at(cond) is None


def test_giving_no_gradient_for_a_while_restores_the_ops_own():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2])
        with graph.gradient_override_map({"Square": "Identity"}):
            overridden = tf.square(x)
        plain = tf.sin(x)
        with compat.gradients_overridden([overridden.op, plain.op], gradient_paths.NO_GRADIENT):
            assert tf.gradients(overridden + plain, x) == [None]
        assert overridden.op.node_def.attr["_gradient_op_type"].s == b"Identity"
        assert not compat.gradient_overridden(plain.op)
