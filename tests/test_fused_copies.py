"""Copies that wait for their level's gradients do so through an input, not
by control inputs of their own (copying.waiting_through_input), so that
Grappler's remapper still fuses them: it fuses no contraction with a control
input, and each level's first MatMul + BiasAdd + Relu copy ran as three
kernels (docs/planner.md, "MLP-256 step time: fused copies").
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from tests.harness import Context
from tests.harness import Model
from tests.harness import assert_matches_stock
from tests.harness import gradients_vs_stock
from tests.harness import waits_for

BLOCKS, WIDTH, BATCH = 6, 16, 32


def _normal(shape, seed, scale=0.3):
    return np.random.default_rng(seed).normal(scale=scale, size=shape).astype(np.float32)


def _residual_mlp(ctx, x):
    """h <- h + relu(h @ w_i + b_i) @ v_i + c_i (scope `block{i}`); every 2nd h kept."""
    h, kept = x, []
    for i in range(BLOCKS):
        with tf.name_scope(f"block{i}"):
            r = tf.nn.relu(tf.nn.bias_add(
                tf.matmul(h, ctx.variable(f"w{i}", _normal((WIDTH, WIDTH), i))),
                ctx.variable(f"b{i}", _normal((WIDTH,), 20 + i))))
            h = h + tf.nn.bias_add(tf.matmul(r, ctx.variable(f"v{i}", _normal((WIDTH, WIDTH), 40 + i))),
                                   ctx.variable(f"c{i}", _normal((WIDTH,), 60 + i)))
        if i % 2 == 1 and i < BLOCKS - 1:
            kept.append(h)
    return Model(ys=[tf.reduce_sum(h * h)], xs=[x] + list(ctx.variables.values()),
                 lists={"two": kept})


def _inputs():
    return {"x": _normal((BATCH, WIDTH), seed=7, scale=1.0)}


def _copy_prefix(name):
    """'<scope>/recompute_<n>' for a copy of a forward op (not its gradients, stubs or gates)."""
    match = re.match(r"(.*/recompute_\d+)/(block\d+/.+)$", name)
    return match.group(1) if match and "/backprop" not in name else None


@pytest.mark.parametrize("runtime", ["function", "session"])
def test_gradients_equal_stock(runtime):
    assert_matches_stock(gradients_vs_stock(runtime, _residual_mlp, _inputs()),
                         rtol=1e-4, atol=1e-4)


def test_copied_matmuls_have_no_control_inputs_and_still_wait_for_their_gate():
    ctx = Context()

    @tf.function(autograph=False)
    def step(x):
        model = _residual_mlp(ctx, x)
        return msg.gradients(model.ys, model.xs, checkpoints=model.lists["two"])

    graph = step.get_concrete_function(tf.TensorSpec((BATCH, WIDTH))).graph
    ops = graph.get_operations()
    copies = [op for op in ops if op.type == "MatMul" and _copy_prefix(op.name)]
    assert len(copies) >= 4
    for copy in copies:
        assert not copy.control_inputs, copy.name
        prefix = _copy_prefix(copy.name)
        gates = [op for op in ops
                 if op.name.startswith(f"{prefix}/wait_for_gradients/") and op.type == "Any"]
        assert len(gates) == 1 and waits_for(copy, gates[0]), copy.name


def test_grappler_fuses_every_copied_matmul():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (BATCH, WIDTH))
        model = _residual_mlp(Context(), x)
        grads = msg.gradients(model.ys, model.xs[1:], checkpoints=model.lists["two"])
        metadata = tf.compat.v1.RunMetadata()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(grads, {x: _inputs()["x"]}, run_metadata=metadata,
                     options=tf.compat.v1.RunOptions(output_partition_graphs=True))
    nodes = [n for g in metadata.partition_graphs for n in g.node]
    # A fused node takes the name of the pattern's last op (a copy's Relu or BiasAdd).
    copies = [n for n in nodes if _copy_prefix(n.name)
              and re.search(r"/(MatMul|BiasAdd|Relu)(_\d+)?$", n.name)]
    assert len(copies) >= 4
    unfused = [(n.name, n.op) for n in copies if "Fused" not in n.op]
    assert not unfused
