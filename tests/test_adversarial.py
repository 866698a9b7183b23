"""Regressions from adversarial testing (issue 14): each case once gave other
gradients than tf.gradients, or crashed where tf.gradients works."""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from harness import Context
from harness import Model
from harness import assert_matches_stock
from harness import control_flow_v1
from harness import gradients_vs_stock
from harness import stock_gradients


def _normal(shape, scale=1.0, seed=0):
    return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


@pytest.mark.parametrize("take_true", [True, False])
def test_v1_cond_with_an_x_downstream(take_true):
    """v1 cond ops are created before the Switch ops feeding them: the model
    must follow data edges, not creation order (else the cond's outputs count
    as weights and the x after it gets its gradient twice)."""
    def build(ctx, x, pred):
        w = ctx.variable("w", _normal((4, 4), 0.5, seed=1))
        h = tf.tanh(tf.matmul(x, w))
        branch = tf.cond(pred, lambda: tf.tanh(h) * 2.0, lambda: tf.sigmoid(h) * 3.0)
        after = tf.tanh(branch * 1.5)
        y = tf.reduce_sum(tf.tanh(after) * after)
        return Model(ys=[y], xs=[x, w, after, branch],
                     lists={"after_cond": [after], "none": []})

    with control_flow_v1():
        outcome = gradients_vs_stock("session", build, {
            "x": _normal((3, 4)), "pred": np.array(take_true)})
    assert_matches_stock(outcome)


def test_integer_shape_checkpoint_stays_a_compile_time_constant_under_xla():
    """Under jit_compile a stub reading a gradient makes copies wait; on an
    integer shape tensor it would stop being a compile-time constant."""
    def build(ctx, x):
        w = ctx.variable("w", _normal((6, 6), 0.5, seed=1))
        shape = tf.shape(tf.tanh(x))
        h = tf.tanh(tf.matmul(x, w))
        folded = tf.reshape(tf.sin(h), tf.stack([shape[0], 3, 2]))
        out = tf.reshape(tf.tanh(folded), tf.shape(h))
        y = tf.reduce_sum(tf.tanh(tf.matmul(out, w)) * out)
        return Model(ys=[y], xs=[x, w], lists={"shape_and_h": [shape, h]})

    outcome = gradients_vs_stock("xla", build, {"x": _normal((4, 6))},
                                 shapes={"x": (None, 6)})
    assert_matches_stock(outcome)


@pytest.mark.parametrize("runtime", ["session", "function"])
def test_nonlinear_custom_gradient_feeding_several_segments(runtime):
    """Partial gradients are summed before they pass through an op: a clipped
    custom gradient sees clip(a + b), never clip(a) + clip(b)."""
    @tf.custom_gradient
    def clip_gradient(h):
        def grad(dy):
            return tf.clip_by_value(dy, -0.3, 0.3)
        return tf.identity(h), grad

    def build(ctx, x):
        w = ctx.variable("w", _normal((6, 6), 0.5, seed=1))
        h = tf.tanh(tf.matmul(x, w))
        clipped = clip_gradient(h * 2.0)
        left = tf.tanh(tf.matmul(tf.sin(clipped), w))
        right = tf.tanh(tf.cos(clipped) * 3.0)
        y = tf.reduce_sum(tf.tanh(left) + tf.sin(right) * 2.0)
        return Model(ys=[y], xs=[x, w], lists={"branch_ends": [left, right],
                                              "one_branch": [left], "with_h": [h, right]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((3, 6))})
    assert_matches_stock(outcome)


@pytest.mark.parametrize("runtime", ["session", "function"])
def test_second_order_through_a_nonlinear_custom_gradient(runtime):
    """A second order through our gradients differentiates a recomputed copy
    beside its original; a clipping custom gradient copied would see its
    parts apart, clip(a) + clip(b), so it is kept and sees clip(a + b)."""
    @tf.custom_gradient
    def clip_gradient(h):
        return tf.identity(h), lambda dy: tf.clip_by_value(dy, -0.3, 0.3)

    def build(ctx, x):  # float64: float32 second orders differ from stock's by rounding
        w = ctx.variable("w", _normal((6, 6), 0.5, seed=1).astype(np.float64))
        clipped = clip_gradient(tf.tanh(tf.matmul(x, w)) * 2.0)
        kept = tf.tanh(tf.matmul(tf.sin(clipped), w))
        y = tf.reduce_sum(tf.tanh(tf.matmul(kept, w)) * kept)
        results = {}
        for name, checkpoints in [("stock", None), ("kept", [kept]), ("none", []),
                                  ("memory", "memory")]:
            grads = (stock_gradients(y, [x, w]) if checkpoints is None
                     else msg.gradients(y, [x, w], checkpoints=checkpoints))
            penalty = tf.add_n([tf.reduce_sum(g ** 2) for g in grads])
            results[name] = stock_gradients(penalty, [x, w])
        return Model(ys=[y], xs=[x], fetch={f"{name}{i}": g for name, grads in results.items()
                                           for i, g in enumerate(grads)})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((3, 6)).astype(np.float64)},
                                 modes=())
    for name in ("kept", "none", "memory"):
        for i in range(2):
            np.testing.assert_allclose(outcome.forward[f"{name}{i}"], outcome.forward[f"stock{i}"],
                                       rtol=1e-9, atol=1e-12,
                                       err_msg=f"{name}: d penalty / d xs[{i}]")


@pytest.mark.parametrize("runtime", ["session", "function"])
def test_second_order_with_respect_to_an_intermediate_x(runtime):
    """With xs=[h, x] and checkpoints=[], h's own op is not recomputed: the
    gradient for x must read h itself, so a penalty on it has tf.gradients'
    derivative with respect to h."""
    def build(ctx, x):
        w = ctx.variable("w", _normal((5, 5), 0.4, seed=1))
        h = tf.tanh(tf.matmul(tf.sin(x), w))
        y = tf.reduce_sum(tf.tanh(tf.matmul(h, w)) ** 2)
        results = {}
        for name, grads in [("stock", stock_gradients(y, [h, x])),
                            ("ours", msg.gradients(y, [h, x], checkpoints=[]))]:
            penalty = tf.reduce_sum(grads[0] ** 2) + tf.reduce_sum(grads[1] ** 2)
            results[name] = stock_gradients(penalty, [h, x, w])
        return Model(ys=[y], xs=[x], fetch={f"{name}{i}": g for name, grads in results.items()
                                           for i, g in enumerate(grads)})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((2, 5))}, modes=())
    for i in range(3):
        np.testing.assert_allclose(outcome.forward[f"ours{i}"], outcome.forward[f"stock{i}"],
                                   rtol=1e-5, atol=1e-6, err_msg=f"d penalty / d xs[{i}]")


def _rnn(x, w, steps=3):
    """A v2 while loop reading `w` in its body."""
    def body(t, h):
        return t + 1, tf.tanh(tf.matmul(h, w) + x)
    return tf.while_loop(lambda t, h: t < steps, body, [0, tf.tanh(x)])[1]


def _assign_in_a_loop(w):
    """A v2 while loop whose body adds 0.5 to `w`."""
    def body(t):
        with tf.control_dependencies([w.assign_add(tf.fill(w.shape, 0.5))]):
            return t + 1
    return tf.while_loop(lambda t: t < 1, body, [0])


@pytest.mark.parametrize("runtime", ["session", "function"])
def test_a_loop_assigning_in_its_body_is_a_writer(runtime):
    """A loop reading w is kept when another loop's body assigns w after it."""
    def build(ctx, x):
        w = ctx.variable("w", _normal((4, 4), 0.4, seed=1))
        h = _rnn(x, w)
        y = tf.reduce_sum(tf.tanh(h) ** 2)
        with tf.control_dependencies([y]):
            written = _assign_in_a_loop(w)
        return Model(ys=[y], xs=[x, w], lists={"after_loop": [h]}, fetch={"written": written})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((2, 4))})
    assert_matches_stock(outcome, forward_unchanged=False)


def test_session_assign_made_after_the_gradients_call():
    """In a Session nothing orders an assign made after `gradients` (on the
    loss only) before a loop rerun that reads the variable: such loops are kept."""
    def build(ctx, x):
        w = ctx.variable("w", _normal((4, 4), 0.4, seed=1))
        h = _rnn(x, w)
        y = tf.reduce_sum(tf.tanh(h) ** 2)
        return Model(ys=[y], xs=[x, w], lists={"after_loop": [h]})

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 4])
        model = build(Context(), x)
        stock = stock_gradients(model.ys, model.xs)
        ours = msg.gradients(model.ys, model.xs, checkpoints=model.lists["after_loop"])
        w = model.xs[1]
        with tf.control_dependencies(model.ys):
            update = w.assign_add(tf.fill(w.shape, 0.5))
        with tf.compat.v1.Session() as sess:
            feed = {x: _normal((2, 4))}
            for _ in range(5):  # the executor's order varies from run to run
                sess.run(tf.compat.v1.global_variables_initializer())
                got_stock, got_ours, _ = sess.run([stock, ours, update], feed)
                for a, b in zip(got_ours, got_stock):
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@tf.custom_gradient
def _sine_with_row_gradient(x):
    """A custom gradient of the wrong shape: one row for a [batch, n] input."""
    def grad(dy):
        return tf.reduce_sum(dy * tf.cos(x), axis=0, keepdims=True)
    return tf.sin(x), grad


def test_partial_gradients_of_mismatched_shapes_add_as_tf_gradients_does():
    """A tensor's partial gradients are added with AddN's rules, not
    broadcasting ones: a part of shape [1, n] beside one of [batch, n] (a
    custom gradient of the wrong shape, unseen while batch is unknown) gave
    other gradients than tf.gradients when the parts were added with
    tf.math.add. Stock and ours each in a function of their own: in one
    graph, Grappler shares their ops and hides the difference."""
    w = tf.constant(_normal((6, 6), 0.4, seed=1).astype(np.float64))

    def gradient_function(gradients):
        @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.float64)], autograph=False)
        def run(x):
            h0 = tf.tanh(tf.matmul(x, w))
            a = tf.tanh(tf.matmul(_sine_with_row_gradient(h0), w))
            b = tf.tanh(tf.matmul(a, w))
            y = tf.reduce_sum(tf.square(tf.tanh(tf.matmul(b, w)) + h0))
            return gradients(y, x, [a, b])
        return run

    x = tf.constant(_normal((4, 6)).astype(np.float64))
    stock = gradient_function(lambda y, x, _: stock_gradients([y], [x])[0])(x)
    ours = gradient_function(lambda y, x, kept: msg.gradients([y], [x], checkpoints=kept)[0])(x)
    np.testing.assert_allclose(ours.numpy(), stock.numpy(), rtol=1e-9, atol=1e-12)
