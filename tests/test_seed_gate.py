"""Levels of batch-norm blocks: a level whose first gradient op reads only its
seed (a batch norm mean's gradient, tiled to full size) waits for the level's
gate (gradient_waits.seed_after_gate), and gradients stay tf.gradients'.
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


@pytest.mark.parametrize("runtime", ["function", "session"])
def test_gradients_equal_stock_with_gated_seeds(runtime):
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
