"""gradient_paths: where tf.gradients would meet an op without a registered gradient, and
where a gradient comes back."""

import pytest
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


def test_a_gradient_comes_back_only_to_the_inputs_their_ops_give_one():
    @tf.custom_gradient
    def doubled_in_backprop(t, scale):
        return t * scale, lambda dy: (2.0 * dy, None)

    graph = tf.Graph()
    with graph.as_default():
        x, w = tf.compat.v1.placeholder(tf.float32, [2]), tf.compat.v1.placeholder(tf.float32, [2])
        floored = tf.floor(tf.sin(x))
        y = floored + doubled_in_backprop(tf.cos(x), tf.exp(w)) + tf.stop_gradient(tf.tanh(w))
    reached = gradient_paths.gradient_comes_back_from(graph.get_operations(), [y])
    assert id(floored) in reached and id(floored.op.inputs[0]) not in reached  # tf.floor's
    assert id(x) in reached  # through the custom gradient's first input
    assert id(w) not in reached  # its second gets None; the stop passes none


@pytest.mark.parametrize("reader, read", [
    (lambda t: tf.reduce_sum(tf.sign(t)), True),  # zeros, but a gradient
    (lambda t: tf.reduce_sum(tf.exp(t)) * 2.0, True),
    (lambda t: tf.floor(t) * 2.0, False),
    (lambda t: tf.stop_gradient(t) * 2.0, False),
    (lambda t: tf.cast(t > 0.0, tf.float32), False),
    (lambda t: tf.truncatemod(t, 0.5), False),  # no gradient registered
    (lambda t: t, False),  # nothing reads it
    (lambda t: tf.floor(tf.identity(t)), True),  # readers' readers not looked at
])
def test_a_tensor_is_read_differentiably_where_a_gradient_can_come_back(reader, read):
    graph = tf.Graph()
    with graph.as_default():
        t = tf.compat.v1.placeholder(tf.float32, [2])
        reader(t)
    assert gradient_paths.read_differentiably(t) == read
