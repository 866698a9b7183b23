"""Adversarial cases for the s20 merge (capture index, one-op gates, new
control edges): gradients must equal stock tf.gradients."""

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


def _norm_blocks(ctx, x, v):
    """Conv, a written-out batch norm (sums_first's broadcast products),
    depthwise conv (a scratch op pair, weight gradient first); checkpointed,
    float64. ys: a Hessian-vector product through the first gradients."""
    h, kept = x, []
    for i in range(3):
        w = ctx.variable(f"w{i}", _normal((3, 3, h.shape[-1], 4), i))
        d = ctx.variable(f"d{i}", _normal((3, 3, 4, 1), 10 + i))
        gamma = ctx.variable(f"gamma{i}", 1.0 + _normal((4,), 20 + i))
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
@pytest.mark.parametrize("runtime", ["function", "session"])
def test_second_order_through_our_gradients_equals_stock(runtime):
    # Second order of tf.gradients (harness: stock) against ours of ours (modes).
    stock = gradients_vs_stock(runtime, _second_order(False), SECOND_INPUTS, modes=())
    ours = gradients_vs_stock(runtime, _second_order(True), SECOND_INPUTS)
    for mode, grads in ours.ours.items():
        for i, (a, b) in enumerate(zip(grads, stock.stock)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=f"{mode} #{i}")
    for a, b in zip(ours.stock, stock.stock):  # stock second order of our first order
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
