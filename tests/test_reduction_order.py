"""A gradient function's full-size products wait for its sums (tfgraph/reduction_order.py).

The gradient of `x * scale` (a broadcast scale: batch norm, layer norm) makes
`grad * scale` (full size) and `sum(x * grad)` (a full-size product summed to
the scale's shape). Unordered, the executor ran both products before the
sum; these tests check that the rewrite orders them, and that gradients stay
tf.gradients'. Also on these batch-norm blocks: a level whose first gradient op
reads only its seed (a mean's gradient) waits for the level's gate
(gradient_waits.seed_after_gate).
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from tests.harness import Context
from tests.harness import Model
from tests.harness import assert_matches_stock
from tests.harness import gradients_vs_stock
from tests.harness import waits_for
from memory_saving_gradients.tfgraph import reduction_order

BLOCKS = 6


def _normal(shape, seed, scale=0.3):
    return np.random.default_rng(seed).normal(scale=scale, size=shape).astype(np.float32)


def _normalized_mlp(ctx, x, blocks=BLOCKS):
    """h <- relu(batch_norm(h @ w_i) * gamma_i + beta_i), block i in scope `block{i}`."""
    width = x.shape[-1]
    h, kept = x, []
    for i in range(blocks):
        with tf.name_scope(f"block{i}"):
            a = tf.matmul(h, ctx.variable(f"w{i}", _normal((width, width), i)))
            mean, variance = tf.nn.moments(a, axes=[0])
            h = tf.nn.relu(tf.nn.batch_normalization(
                a, mean, variance, ctx.variable(f"beta{i}", _normal((width,), 50 + i)),
                ctx.variable(f"gamma{i}", 1 + _normal((width,), 100 + i)), 1e-3))
        if i % 3 == 2:
            kept.append(h)
    return Model(ys=[tf.reduce_sum(h * h)], xs=[x] + list(ctx.variables.values()),
                 lists={"three": kept})


def _traced_graph():
    ctx = Context()

    @tf.function(autograph=False)
    def step(x):
        model = _normalized_mlp(ctx, x)
        return msg.gradients(model.ys, model.xs, checkpoints=model.lists["three"])

    return step.get_concrete_function(tf.TensorSpec((32, 16))).graph


def test_a_batch_norms_input_product_waits_for_its_scale_sum():
    graph = _traced_graph()
    ops = [op for op in graph.get_operations()
           if "recompute_" in op.name and "backprop" in op.name
           and op.name.rpartition("/")[0].endswith("batchnorm/mul_1_grad")]
    checked = 0
    for block in range(BLOCKS):
        scope = [op for op in ops if f"/block{block}/" in op.name]
        if not scope:
            continue
        (product,) = [op for op in scope if op.type == "Mul" and op.name.endswith("/Mul")]
        (scale_sum,) = [op for op in scope if op.type == "Sum"]
        assert waits_for(product, scale_sum), (block, product.name)
        checked += 1
    assert checked >= BLOCKS - 2, [op.name for op in ops]


def test_no_edge_where_the_sum_needs_the_product():
    graph = tf.Graph()
    with graph.as_default(), tf.name_scope("f_grad"):
        g = tf.compat.v1.placeholder(tf.float32, (64, 8))
        big = g * 2.0  # the product the sum reads: may not wait for it
        total = tf.reduce_sum(big * g, axis=0)
    assert reduction_order.reductions_first(graph.get_operations()) == 0
    assert not waits_for(big.op, total.op)


@pytest.mark.parametrize("runtime", ["function", "session"])
def test_gradients_equal_stock_with_sums_first(runtime):
    inputs = {"x": _normal((32, 16), seed=7, scale=1.0)}
    assert_matches_stock(gradients_vs_stock(runtime, _normalized_mlp, inputs),
                         rtol=1e-4, atol=1e-4)


def test_a_level_starting_from_a_means_gradient_waits_for_its_gate():
    # With a batch norm's mean a checkpoint, its level's first gradient op
    # (the mean's gradient, tiled to full size) reads only the seed; it began
    # beside the level above until the seed waited for the level's gate.
    ctx = Context()

    @tf.function(autograph=False)
    def step(x):
        model = _normalized_mlp(ctx, x)
        graph = tf.compat.v1.get_default_graph()
        means = [graph.get_tensor_by_name(f"block{i}/moments/Squeeze:0") for i in (1, 4)]
        return msg.gradients(model.ys, model.xs, checkpoints=model.lists["three"] + means)

    graph = step.get_concrete_function(tf.TensorSpec((32, 16))).graph
    ops = graph.get_operations()
    tiles = [op for op in ops if op.type == "Tile" and "/moments/mean_grad/" in op.name]
    assert len(tiles) >= 2
    for tile in tiles:
        level = tile.name.split("/backprop/")[0]  # gradients/recompute_<n>
        gates = [op for op in ops
                 if op.name.startswith(f"{level}/wait_for_gradients/") and op.type == "Any"]
        assert len(gates) == 1 and waits_for(tile, gates[0]), tile.name
