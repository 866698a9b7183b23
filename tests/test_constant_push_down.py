"""Constants a gradient scales by wait for what they scale (tfgraph/constant_push_down.py).

Grappler rewrites `(g * x) / 6` into `g * (x * (1 / 6))`, and `x * (1 / 6)`,
depending on no gradient, then runs in the forward pass. `pin` makes such
constants wait for the product they scale (not under XLA, which orders the step
itself). The measured effect on MobileNetV3Small is
test_memory_model's `test_hard_swish_gradients_run_in_backprop`.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import constant_push_down
from tests.harness import Model
from tests.harness import assert_an_order_of_runs
from tests.harness import assert_matches_stock
from tests.harness import gradients_vs_stock
from tests.harness import spy
from tests.harness import stock_gradient_ops


def _hard_swish(h):
    """Keras' form: x * (relu6(x + 3) / 6)."""
    return h * (tf.nn.relu6(h + 3.0) / 6.0)


def _hard_swish_chain(dtype):
    def build(ctx, x):
        h = x
        for i in range(4):
            w = ctx.variable(f"w{i}", np.random.default_rng(i).normal(
                scale=0.5, size=(h.shape[-1], 8)).astype(dtype))
            h = _hard_swish(tf.matmul(h, w) + (1.0 - 0.5 * i))
        return Model(ys=[tf.reduce_sum(h * h)], xs=[x] + list(ctx.variables.values()))
    return build


def _stock_gradient_ops(build_loss):
    """The ops tf.gradients makes for `build_loss(x)`'s gradient to x, in order."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [16, 8])
        return stock_gradient_ops(build_loss(x), [x])[1]


def test_the_quotient_of_a_hard_swish_is_found():
    ops = _stock_gradient_ops(lambda x: tf.reduce_sum(_hard_swish(x)))
    sites = constant_push_down.pushed_down(ops)
    assert [(op.type, index) for op, index in sites] == [("RealDiv", 1)]
    op, index = sites[0]
    assert op.inputs[index].op.type == "Const" and op.inputs[1 - index].op.type == "Mul"


@pytest.mark.parametrize("loss", [lambda x: tf.reduce_sum(tf.exp(x) / 6.0),
                                  lambda x: tf.reduce_sum(tf.exp(x)) * 3.0])
def test_constants_scaling_the_gradient_alone_are_left(loss):
    # The quotient's or product's other operand is the incoming gradient: no
    # rotation pairs the constant with a forward tensor.
    assert constant_push_down.pushed_down(_stock_gradient_ops(loss)) == []


def test_pinned_constants_come_before_what_reads_them():
    ops = _stock_gradient_ops(lambda x: tf.reduce_sum(_hard_swish(_hard_swish(x))))
    sites = constant_push_down.pushed_down(ops)
    assert len(sites) == 2
    ordered = constant_push_down.pin(ops)
    assert set(ops) <= set(ordered) and len(ordered) > len(ops)
    assert_an_order_of_runs(ordered)
    for op, index in sites:  # no longer a constant, and it waits for the product
        assert op.inputs[index].op.type != "Const"
        assert constant_push_down.pushed_down([op]) == []


@pytest.fixture(name="pinned")
def _pinned(monkeypatch):
    """Counts the ops `pin` adds, per call while the test runs."""
    return spy(monkeypatch, constant_push_down, "pin",
               lambda args, ordered: len(ordered) - len(args[0]))


@pytest.mark.parametrize("runtime", ["session", "function", "xla"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_gradients_equal_stock(runtime, dtype, pinned):
    inputs = {"x": np.random.default_rng(7).normal(size=(16, 8)).astype(dtype)}
    outcome = gradients_vs_stock(runtime, _hard_swish_chain(dtype), inputs)
    tolerance = (1e-11, 1e-12) if dtype == np.float64 else (1e-4, 1e-5)
    assert_matches_stock(outcome, *tolerance)
    if runtime == "xla":  # XLA orders the step itself: nothing pinned
        assert sum(pinned) == 0, pinned
    else:  # the hard swishes' quotients, in both modes
        assert sum(pinned) >= 4, pinned


def test_float16_under_xla_rounds_as_stock(pinned):
    # Pinned, the gradient would compute (g * x) / 6 in TensorFlow's order,
    # and g * x = 30000 * 2.5 overflows float16; XLA computes g * (x * (1 / 6))
    # for tf.gradients and, unpinned, for ours: 40000 exactly.
    def step(x):
        y = tf.reduce_sum(_hard_swish(x) * tf.constant(30000.0, tf.float16))
        return tf.gradients(y, [x])[0], msg.gradients(y, [x], checkpoints=[])[0]
    step = tf.function(step, jit_compile=True)
    stock, ours = step(tf.fill([2, 4], tf.constant(2.5, tf.float16)))
    np.testing.assert_array_equal(ours.numpy(), stock.numpy())
    assert np.all(stock.numpy() == 40000.0) and sum(pinned) == 0, pinned
