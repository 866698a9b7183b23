"""A broadcast product's sum runs before its sibling product (tfgraph/product_order.py).

The gradient of `x * inv` (inv broadcast along the last axis, as in an unfused
batch norm) is `grad * inv` for x and `sum(x * grad)` for inv, both products
full size. The rewrite makes `grad * inv` wait for the sum, so the temporary
`x * grad` is freed before `grad * inv` allocates (or takes `grad`'s buffer).
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import product_order
from tests.harness import Context
from tests.harness import Model
from tests.harness import assert_matches_stock
from tests.harness import gradients_vs_stock

INPUTS = {"x": np.random.default_rng(0).normal(size=(8, 6, 6, 16)).astype(np.float32)}


def _normal(shape, seed):
    return np.random.default_rng(seed).normal(scale=0.3, size=shape).astype(np.float32)


def _scaled_blocks(ctx, x, blocks=3):
    """Conv, an unfused batch norm written out (x * inv + shift), tanh, per block."""
    h = x
    for i in range(blocks):
        w = ctx.variable(f"w{i}", _normal((3, 3, h.shape[-1], 16), seed=i))
        gamma = ctx.variable(f"gamma{i}", 1.0 + _normal((16,), seed=10 + i))
        y = tf.nn.conv2d(h, w, 1, "SAME")
        mean, variance = tf.nn.moments(y, [0, 1, 2])
        inv = tf.math.rsqrt(variance + 1e-3) * gamma
        h = tf.tanh(y * inv - mean * inv)
    return Model(ys=[tf.reduce_sum(h * h)], xs=[x] + list(ctx.variables.values()))


def _elements(tensor):
    return tensor.shape.num_elements()


def _gradient_products(graph):
    """(grad * inv, the sum of x * grad) of each `y * inv` gradient in the graph."""
    pairs = []
    for op in graph.get_operations():
        scope = op.name.rpartition("/")[0]
        if op.type != "Sum" or _elements(op.inputs[0]) <= _elements(op.outputs[0]):
            continue
        product = op.inputs[0].op
        shared = [t for t in product.inputs if t.shape == product.outputs[0].shape]
        pairs += [(c, op) for t in shared for c in t.consumers()
                  if c is not product and c.type == "Mul" and c.name.rpartition("/")[0] == scope]
    return pairs


def test_sibling_product_waits_for_the_sum():
    ctx = Context()
    found = {}

    @tf.function(autograph=False)
    def step(x):
        model = _scaled_blocks(ctx, x)
        found["grads"] = msg.gradients(model.ys, model.xs, checkpoints="memory")
        return found["grads"]

    graph = step.get_concrete_function(tf.TensorSpec(INPUTS["x"].shape)).graph
    pairs = _gradient_products(graph)
    assert len(pairs) >= 3, [(a.name, b.name) for a, b in pairs]  # one per block at least
    for sibling, reduction in pairs:
        assert reduction in sibling.control_inputs, (sibling.name, reduction.name)


def test_no_edge_where_the_sum_needs_the_sibling():
    graph = tf.Graph()
    with graph.as_default():
        grad = tf.compat.v1.placeholder(tf.float32, [64, 8])
        needed = grad * 2.0
        reduction = tf.reduce_sum(grad * needed, 0)  # the temporary reads `needed`
        independent = grad * 3.0
        unneeded = tf.reduce_sum(grad * grad, 0)  # nobody reads it: it must not be made to run
    new_ops = [op for op in graph.get_operations() if op.type != "Placeholder"]
    assert product_order.sums_first(new_ops, [reduction, needed, independent]) == 1
    assert reduction.op in independent.op.control_inputs
    assert not needed.op.control_inputs  # it would make a cycle
    assert unneeded.op not in independent.op.control_inputs


@pytest.mark.parametrize("runtime", ["function", "session"])
def test_gradients_equal_stock_with_sums_first(runtime):
    assert_matches_stock(gradients_vs_stock(runtime, _scaled_blocks, INPUTS), rtol=1e-4, atol=1e-4)


def test_no_edge_where_the_sum_needs_the_sibling_through_other_ops():
    # The path from the sibling to the sum passes an op the call did not make
    # (a BERT encoder's step failed with a cycle when the walk stayed among the new ops).
    graph = tf.Graph()
    with graph.as_default():
        grad = tf.compat.v1.placeholder(tf.float32, [64, 8])
        sibling = grad * 2.0
        elsewhere = tf.identity(sibling)
        reduction = tf.reduce_sum(grad * elsewhere, 0)
    new_ops = [op for op in graph.get_operations()
               if op.type != "Placeholder" and op is not elsewhere.op]
    assert product_order.sums_first(new_ops, [reduction, sibling]) == 0
    assert not sibling.op.control_inputs
