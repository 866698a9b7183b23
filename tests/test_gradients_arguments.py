"""Our gradients take tf.gradients' arguments and calls as stock does: several ys
with grad_ys, unconnected xs, stop_gradients, intermediate tensors as xs, two calls
on one graph, options passed through, gradients of our gradients; and the rewrite
leaves the forward ops and their devices alone.

Built once per runtime with `gradients_vs_stock` (harness.py), as in test_models.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from harness import Model
from harness import assert_matches_stock
from harness import gradients_vs_stock
from harness import recompute_copies
from harness import stock_gradients
from models import dense_layers
from models import normal


# --- tf.gradients arguments ---------------------------------------------------------

def test_several_ys_with_grad_ys(runtime):
    def build(ctx, x, seed_a, seed_c):
        ws = dense_layers(ctx, [5, 5, 5, 5, 5])
        hs = [x]
        for w in ws:
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        ys = [hs[-1], hs[2], tf.reduce_sum(hs[3])]
        return Model(ys=ys, xs=[x] + ws, grad_ys=[seed_a, None, seed_c],
                     lists={"inner": [hs[1], hs[3]], "with_a_y": [hs[2], hs[3]]})

    outcome = gradients_vs_stock(runtime, build, {
        "x": normal((3, 5)), "seed_a": normal((3, 5), seed=7),
        "seed_c": np.float32(-2.0)})
    assert_matches_stock(outcome)


@pytest.mark.parametrize("unconnected", [None, "zero"])
def test_unconnected_xs(runtime, unconnected):
    def build(ctx, x, other):
        w = ctx.variable("w", normal((4, 4), 0.5, seed=1))
        unused = ctx.variable("unused", normal((4, 4), seed=2))
        hs = [x]
        for _ in range(5):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        side = tf.tanh(other)  # depends on an x, but no y depends on it
        kwargs = {} if unconnected is None else {"unconnected_gradients": unconnected}
        return Model(ys=[tf.reduce_sum(hs[-1])], xs=[x, unused, w, other, side],
                     kwargs=kwargs, lists={"mid": [hs[2]]})

    outcome = gradients_vs_stock(runtime, build, {
        "x": normal((2, 4)), "other": normal((3,), seed=3)})
    if unconnected is None:
        assert outcome.stock[1] is None and outcome.stock[3] is None
    else:
        assert outcome.stock[1].shape == (4, 4) and not outcome.stock[1].any()
    assert_matches_stock(outcome)


def _leaky_residual_stack(ctx, x, depth=8):
    """A variable w, the block outputs [x, h1, ..., h_depth], and a scalar loss."""
    w = ctx.variable("w", normal((6, 6), 0.5, seed=1))
    hs = [x]
    for _ in range(depth):
        hs.append(tf.tanh(tf.matmul(hs[-1], w)) + 0.5 * hs[-1])
    return w, hs, tf.reduce_sum(tf.square(hs[-1]))


def test_stop_gradients_pass_through(runtime):
    def build(ctx, x):
        w, hs, y = _leaky_residual_stack(ctx, x)
        return Model(ys=[y], xs=[x, w], kwargs={"stop_gradients": [hs[3], hs[6]]},
                     lists={"around_stops": [hs[2], hs[4], hs[7]], "at_stop": [hs[3]]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 6))})
    assert_matches_stock(outcome)


def test_intermediate_tensor_as_x(runtime):
    def build(ctx, x):
        w, hs, y = _leaky_residual_stack(ctx, x)
        # x and w twice: tf.gradients answers each entry; none counts twice.
        return Model(ys=[y], xs=[hs[4], x, w, hs[2], x, w, y],
                     lists={"around": [hs[3], hs[6]], "at_x": [hs[4]]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 6))})
    assert_matches_stock(outcome)


def test_gradients_called_twice_on_one_graph(runtime):
    def build(ctx, x):
        w = ctx.variable("w", normal((6, 6), 0.5, seed=1))
        hs = [x]
        for _ in range(8):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        # The same explicit list twice, after 'memory' and 'speed' already ran.
        return Model(ys=[y], xs=[x, w], lists={"first": hs[2::3], "again": hs[2::3]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 6))})
    assert len(outcome.ours) == 4
    assert_matches_stock(outcome)


def test_forward_ops_are_untouched_by_the_rewrite():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 6])
        w = tf.Variable(normal((6, 6), 0.5))
        hs = [x]
        for _ in range(6):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        before = {op.name: ([i.name for i in op.inputs], [c.name for c in op.control_inputs])
                  for op in graph.get_operations()}
        for mode in ("memory", "speed", hs[2::2]):
            msg.gradients(y, [x, w], checkpoints=mode)
        after = {op.name: ([i.name for i in op.inputs], [c.name for c in op.control_inputs])
                 for op in graph.get_operations() if op.name in before}
        assert after == before


def test_a_v1_reference_variable_as_an_x():
    # Its `handle` was asked for, which only resource variables have (a review
    # found the AttributeError): it is its reference, as for tf.gradients.
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.Variable(normal((6, 6), 0.5), use_resource=False)
        x = tf.compat.v1.placeholder(tf.float32, [2, 6])
        hs = [x]
        for _ in range(6):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1] ** 2)
        ours = {mode: msg.gradients(y, [w], checkpoints=mode) for mode in ("memory", "speed")}
        stock = tf.gradients(y, [w])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, want = sess.run([ours, stock], {x: normal((2, 6))})
    for mode in ours:
        np.testing.assert_allclose(got[mode][0], want[0], rtol=1e-5, atol=1e-6)


def test_copies_keep_their_originals_device(runtime):
    def build(ctx, x):
        ws = dense_layers(ctx, [6, 6, 6, 6, 6, 6])
        with tf.device("/cpu:0"):
            hs = [x]
            for w in ws:
                hs.append(tf.tanh(tf.matmul(hs[-1], w)) * 1.5)
            y = tf.reduce_sum(hs[-1])
        return Model(ys=[y], xs=[x] + ws, lists={"list": hs[2::2]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 6))})
    assert_matches_stock(outcome)
    copies = recompute_copies(outcome)
    assert {"Tanh", "Mul"} <= {original.type for _, original in copies}
    for copy, original in copies:
        if original.type in ("Tanh", "Mul", "MatMul"):
            assert "CPU:0" in original.device, original.name
        assert copy.device == original.device, (copy.name, copy.device, original.device)


@pytest.mark.parametrize("kwargs", [
    {"gate_gradients": True},
    {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N},
    {"colocate_gradients_with_ops": True, "name": "my_gradients"},
], ids=["gate", "accumulate_n", "colocate_and_name"])
def test_tf_gradients_options_pass_through(runtime, kwargs):
    def build(ctx, x):
        ws = [ctx.variable(f"w{i}", normal((6, 6), 0.3, seed=i)) for i in range(4)]
        hs = [x]
        for w in ws:
            hs.append(hs[-1] + tf.tanh(tf.matmul(hs[-1], w)) * hs[-1])
        y = tf.reduce_sum(tf.square(hs[-1]))
        return Model(ys=[y], xs=[x] + ws, kwargs=kwargs, lists={"stream": hs[1:3]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((3, 6))})
    assert_matches_stock(outcome)


def test_gradient_of_our_gradient(runtime):
    """A gradient penalty: stock tf.gradients differentiates through our rewrite."""
    def build(ctx, x):
        ws = [ctx.variable(f"w{i}", normal((5, 5), 0.4, seed=i)) for i in range(4)]
        hs = [x]
        for w in ws:
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        stock_dx = stock_gradients(y, x)[0]
        ours_dx = msg.gradients(y, x, checkpoints="memory")[0]
        return Model(ys=[y], xs=ws, fetch={
            "stock": tf.stack(stock_gradients(tf.reduce_sum(stock_dx ** 2), ws)),
            "ours": tf.stack(stock_gradients(tf.reduce_sum(ours_dx ** 2), ws))})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 5))})
    # The fetches are gradients, not forward values: rounding may differ per graph.
    assert_matches_stock(outcome, forward_unchanged=False)
    np.testing.assert_allclose(outcome.forward["ours"], outcome.forward["stock"],
                               rtol=1e-5, atol=1e-6)
