"""A level's gradient ops wait for all the copies its backprop reads
(gradient_waits.hold_until_copied), as the planner's timeline runs them: with
several inter-op threads a gradient op reading the arriving gradient and one
recomputed tensor no longer runs beside the copies still being made (a batch
norm's product of the gradient and its recomputed input beside the recomputed
variance's squared differences). Gradients stay tf.gradients'.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import compat
from tests.harness import Context
from tests.harness import Model
from tests.harness import assert_matches_stock
from tests.harness import gradients_vs_stock

BLOCKS = 6


def _normal(shape, seed, scale=0.3):
    return np.random.default_rng(seed).normal(scale=scale, size=shape).astype(np.float32)


def _swish_batch_norm_mlp(ctx, x, blocks=BLOCKS):
    """h <- silu(batch_norm(h @ w_i)), block i in scope `block{i}`; every third h listed."""
    width = x.shape[-1]
    h, kept = x, []
    for i in range(blocks):
        with tf.name_scope(f"block{i}"):
            a = tf.matmul(h, ctx.variable(f"w{i}", _normal((width, width), i)))
            mean, variance = tf.nn.moments(a, axes=[0])
            h = tf.nn.silu(tf.nn.batch_normalization(
                a, mean, variance, ctx.variable(f"beta{i}", _normal((width,), 50 + i)),
                ctx.variable(f"gamma{i}", 1 + _normal((width,), 100 + i)), 1e-3))
        if i % 3 == 2:
            kept.append(h)
    return Model(ys=[tf.reduce_sum(h * h)], xs=[x] + list(ctx.variables.values()),
                 lists={"three": kept})


@pytest.mark.parametrize("runtime", ["function", "session"])
def test_gradients_equal_stock_with_gradient_ops_after_copies(runtime):
    inputs = {"x": _normal((32, 16), seed=7, scale=1.0)}
    assert_matches_stock(gradients_vs_stock(runtime, _swish_batch_norm_mlp, inputs),
                         rtol=1e-4, atol=1e-4)


def _after(op) -> set:
    """Every op that runs after `op` (data or control edges)."""
    found, todo = set(), [op]
    while todo:
        first = todo.pop()
        for later in [c for t in first.outputs for c in t.consumers()] + \
                compat.control_outputs(first):
            if later not in found:
                found.add(later)
                todo.append(later)
    return found


def _before(ops) -> set:
    """`ops` and every op they run after."""
    found, todo = set(ops), list(ops)
    while todo:
        later = todo.pop()
        for earlier in [t.op for t in later.inputs] + list(later.control_inputs):
            if earlier not in found:
                found.add(earlier)
                todo.append(earlier)
    return found


@pytest.mark.parametrize("checkpoints", ["three", "memory"])
def test_every_gradient_op_reading_a_copy_waits_for_all_copies_read(checkpoints):
    ctx = Context()

    @tf.function(autograph=False)
    def step(x):
        model = _swish_batch_norm_mlp(ctx, x)
        chosen = model.lists["three"] if checkpoints == "three" else checkpoints
        return msg.gradients(model.ys, model.xs, checkpoints=chosen)

    graph = step.get_concrete_function(tf.TensorSpec((32, 16))).graph
    ops = graph.get_operations()
    names = {op.name for op in ops}
    run = _before([t.op for t in graph.outputs])
    levels = {op.name.split("/")[1] for op in ops if op.name.startswith("gradients/recompute_")}
    assert levels
    checked = 0
    for level in levels:
        prefix = f"gradients/{level}/"

        def is_copy(op, prefix=prefix):  # a copy bears its original's name under the level's scope
            original = op.name[len(prefix):]
            return op.name.startswith(prefix) and original.startswith("block") and original in names

        # Gradient ops that run: TensorFlow prunes the others (silu's gradient for its beta).
        readers = [op for op in ops if op.name.startswith(prefix + "backprop/") and op in run
                   and any(is_copy(t.op) for t in op.inputs)]
        copies_read = {t.op for op in readers for t in op.inputs if is_copy(t.op)}
        for copy in copies_read:
            later = _after(copy)
            early = [op.name for op in readers if op not in later]
            assert not early, (copy.name, early[:3])
            checked += len(readers)
    assert checked
