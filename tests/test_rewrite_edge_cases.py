"""Edge cases of the capture index, the one-op gates and the ordering edges
(rank 9, second order, loops and conds beside norm blocks, sparse gradients):
gradients must equal stock tf.gradients'."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg

from harness import Model, assert_matches_stock, gradients_vs_stock

RANK9 = [2] * 9


def _rank9_chain(ctx, x):
    """A weight of rank 9 (the gates read its gradient), checkpointed chain."""
    w = ctx.variable("w", np.linspace(0.5, 1.5, 512).reshape(RANK9).astype(np.float32))
    hs = [x]
    for _ in range(6):
        hs.append(tf.tanh(hs[-1] * w))
    return Model(ys=[tf.reduce_sum(hs[-1] ** 2)], xs=[w, x], lists={"mid": [hs[2], hs[4]]})


@pytest.fixture
def no_grappler():
    """Grappler off: it happens to rewrite a rank-9 StridedSlice away, which
    hides the kernel's 8-dimension limit (users may run without it)."""
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    yield
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})


def test_a_gate_over_a_rank_9_gradient_runs(runtime, no_grappler):
    # The gate's one-op StridedSlice (every axis shrunk) has no CPU kernel
    # beyond rank 8: "Unhandled input dimensions 9" where stock runs.
    x = np.linspace(-1, 1, 512).reshape(RANK9).astype(np.float32)
    assert_matches_stock(gradients_vs_stock(runtime, _rank9_chain, {"x": x}))


def _normal(shape, seed):
    return np.random.default_rng(seed).normal(scale=0.3, size=shape)


def _norm_blocks(ctx, x, v, prefix=""):
    """Conv, a written-out batch norm (sums_first's broadcast products),
    depthwise conv (a scratch op pair, weight gradient first); checkpointed,
    float64. ys: a Hessian-vector product through the first gradients."""
    h, kept = x, []
    for i in range(3):
        w = ctx.variable(f"{prefix}w{i}", _normal((3, 3, h.shape[-1], 4), i))
        d = ctx.variable(f"{prefix}d{i}", _normal((3, 3, 4, 1), 10 + i))
        gamma = ctx.variable(f"{prefix}gamma{i}", 1.0 + _normal((4,), 20 + i))
        y = tf.nn.conv2d(h, w, 1, "SAME")
        mean, variance = tf.nn.moments(y, [0, 1, 2])
        inv = tf.math.rsqrt(variance + 1e-3) * gamma
        h = tf.tanh(tf.nn.depthwise_conv2d(y * inv - mean * inv, d, [1, 1, 1, 1], "SAME"))
        kept.append(h)
    weights = list(ctx.variables.values())
    return h, kept, weights


def _second_order(ours):
    def build(ctx, x, v):
        h, kept, weights = _norm_blocks(ctx, x, v)
        loss = tf.reduce_sum(h * h)
        if ours:
            first = msg.gradients(loss, [x] + weights, checkpoints=kept[:-1])
        else:
            first = tf.gradients(loss, [x] + weights)
        return Model(ys=[tf.reduce_sum(first[0] * v) + sum(tf.reduce_sum(g) for g in first[1:])],
                     xs=[x] + weights)
    return build


SECOND_INPUTS = {"x": _normal((2, 5, 5, 3), 30), "v": _normal((2, 5, 5, 3), 31)}


@pytest.mark.slow
def test_second_order_through_our_gradients_equals_stock(runtime):
    # Second order of tf.gradients (harness: stock) against ours of ours (modes).
    stock = gradients_vs_stock(runtime, _second_order(False), SECOND_INPUTS, modes=())
    ours = gradients_vs_stock(runtime, _second_order(True), SECOND_INPUTS)
    for mode, grads in ours.ours.items():
        for i, (a, b) in enumerate(zip(grads, stock.stock)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=f"{mode} #{i}")
    for a, b in zip(ours.stock, stock.stock):  # stock second order of our first order
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def _norm_blocks_with_control_flow(ctx, x, v):
    """The norm blocks, with a while loop reading a variable and a cond between
    them (the new control edges next to loops and conds); gradients to the
    input and every variable."""
    h, kept, weights = _norm_blocks(ctx, x, v)
    s = ctx.variable("s", np.float64(0.9))
    _, h = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, tf.tanh(a * s + v[..., :1])),
                         [0, h], maximum_iterations=3)
    h = tf.cond(tf.reduce_sum(h) > 0, lambda: h * s, lambda: tf.sin(h))
    h2, kept2, _ = _norm_blocks(ctx, h, v[..., :1] + tf.zeros_like(h), prefix="top")
    return Model(ys=[tf.reduce_sum(h2 * h2)], xs=[x] + list(ctx.variables.values()),
                 lists={"blocks": kept + [h] + kept2[:-1]})


@pytest.mark.slow
def test_norm_blocks_around_loops_and_conds_equal_stock(runtime):
    # float64: the chain's sums and rsqrt are sensitive to summation order.
    assert_matches_stock(gradients_vs_stock(runtime, _norm_blocks_with_control_flow,
                                            SECOND_INPUTS), rtol=1e-9, atol=1e-12)


def _embedding_norm(ctx, ids):
    """IndexedSlices gradients (a gathered table) into gates, beside a
    written-out layer norm's broadcast products."""
    table = ctx.variable("table", _normal((20, 8), 40))
    scale = ctx.variable("scale", 1.0 + _normal((8,), 41))
    h, kept = tf.gather(table, ids), []
    for i in range(4):
        w = ctx.variable(f"m{i}", _normal((8, 8), 42 + i))
        y = tf.matmul(h, w)
        mean, variance = tf.nn.moments(y, [-1], keepdims=True)
        h = tf.tanh((y - mean) * tf.math.rsqrt(variance + 1e-3) * scale)
        kept.append(h)
    return Model(ys=[tf.reduce_sum(h * h)], xs=list(ctx.variables.values()),
                 lists={"blocks": kept[:-1]})


@pytest.mark.parametrize("runtime", ["function", "session"])
def test_sparse_gradients_through_gates_equal_stock(runtime):
    ids = np.array([[1, 3, 3, 7], [0, 19, 3, 2]], np.int32)
    assert_matches_stock(gradients_vs_stock(runtime, _embedding_norm, {"ids": ids}),
                         rtol=1e-9, atol=1e-12)


def test_ys_that_are_all_checkpoints_get_their_seeds_as_stock():
    # Every y a checkpoint (as a decorated layer's outputs are): the first
    # phase hands each seed to the source it is without tf.gradients' walk.
    # A y twice, a y below another, ys that are xs, a sparse seed.
    table = tf.Variable(_normal((6, 4), 50))
    w = tf.Variable(1.0 + _normal((4,), 51))
    ids = tf.constant([0, 2, 2, 5])

    @tf.function
    def both():
        read = tf.identity(table)
        below = tf.tanh(tf.gather(read, ids) * w)
        above = below * below + w
        ys, xs = [above, below, above, read], [table, w, below, read]
        grad_ys = [tf.constant(_normal((4, 4), 60 + i)) for i in range(3)]
        grad_ys.append(tf.IndexedSlices(tf.constant(_normal((4, 4), 63)), ids, tf.constant([6, 4])))
        ours = msg.gradients(ys, xs, grad_ys=grad_ys, checkpoints=ys)
        stock = tf.gradients(ys, xs, grad_ys=grad_ys)
        return [tf.convert_to_tensor(g) for g in ours], [tf.convert_to_tensor(g) for g in stock]

    ours, stock = both()
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("checkpoints", ["none", "memory", "speed", "below", "call"])
def test_an_x_computed_from_another_x_is_counted_once(checkpoints):
    # h = sin(x) with x and h both xs: the first phase passes h's part on to
    # x, so phase 3 must not send it through sin a second time (x's gradient
    # was twice stock's). The call's output at a user's stop: tf.gradients
    # differentiates a nested tf.function there all the same.
    x0 = tf.constant(np.linspace(-1, 1, 6).reshape(2, 3))

    @tf.function
    def inner(a):
        return tf.tanh(a) * 2.0

    @tf.function
    def both():
        x = tf.identity(x0)
        h = tf.sin(x)
        g = inner(h)
        y = g * g + h
        xs, options = [x, h], {}
        chosen = {"none": [], "below": [g], "call": [g]}.get(checkpoints, checkpoints)
        if checkpoints == "call":
            xs, options = [x, h, g], {"stop_gradients": [g]}
        ours = msg.gradients([y], xs, checkpoints=chosen, **options)
        return ours, tf.gradients([y], xs, **options)

    ours, stock = both()
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("checkpoints", [["h2"], ["h"], "memory"])
def test_a_second_order_by_a_recording_tape_equals_stock(checkpoints, caplog):
    # A tape watching the ys records their gradient ops as they are made,
    # before the rewrite rewires some: its second order through ours was wrong
    # (up to 4x off); `gradients` runs as tf.gradients then, and says so.
    rng = np.random.default_rng(3)
    x0 = tf.constant(rng.normal(size=(4, 3)))
    v = tf.Variable(rng.normal(size=(3, 3)))

    def second_order(differentiate):
        @tf.function
        def step():
            x = tf.identity(x0)
            with tf.GradientTape() as tape:
                tape.watch(x)
                h = tf.tanh(tf.matmul(x, v))
                h2 = h * h
                named = {"h": h, "h2": h2}
                chosen = ([named[n] for n in checkpoints] if isinstance(checkpoints, list)
                          else checkpoints)
                dh2, dx, dv = differentiate([h2], [h2, x, v], [h * 3.0], chosen)
                penalty = tf.reduce_sum(dh2 ** 2) + tf.reduce_sum(dx) + tf.reduce_sum(dv * v)
            return [dh2, dx, dv] + tape.gradient(penalty, [x, v])
        return step()

    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        ours = second_order(lambda ys, xs, seeds, chosen: msg.gradients(
            ys, xs, grad_ys=seeds, checkpoints=chosen))
    stock = second_order(lambda ys, xs, seeds, chosen: tf.gradients(ys, xs, grad_ys=seeds))
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)
    assert "tf.gradients is used, without recomputation" in caplog.text


@pytest.mark.parametrize("checkpoints", [["h"], "memory"])
def test_a_forward_accumulator_over_our_gradients_equals_stock(checkpoints, caplog):
    # Forward over reverse (a Hessian-vector product): an accumulator's JVPs
    # of our gradients were wrong (up to 3x off) for the same reason as a
    # tape's second order; `gradients` runs as tf.gradients then.
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(4, 3)))
    v = tf.Variable(rng.normal(size=(3, 3)))
    tangent = tf.constant(rng.normal(size=(3, 3)))

    def product(differentiate):
        @tf.function
        def step():
            with tf.autodiff.ForwardAccumulator(v, tangent) as accumulator:
                h = tf.tanh(tf.matmul(x, v))
                y = tf.reduce_sum((tf.sin(tf.tanh(h * h * 3.0)) * h) ** 2)
                chosen = [h] if isinstance(checkpoints, list) else checkpoints
                (dv,) = differentiate(y, [v], chosen)
            return dv, accumulator.jvp(dv)
        return step()

    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        ours = product(lambda y, xs, chosen: msg.gradients(y, xs, checkpoints=chosen))
    stock = product(lambda y, xs, chosen: tf.gradients(y, xs))
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)
    assert "tf.gradients is used, without recomputation" in caplog.text
