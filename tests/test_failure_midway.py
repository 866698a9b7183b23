"""An exception raised midway through the rewrite leaves the user's graph and
tf.gradients as they were (capture_lookup's patch undone, no edge added to an
existing op)."""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import rewrite


def _snapshot(graph):
    return {op.name: (op.node_def.SerializeToString(deterministic=True),
                      tuple(c.name for c in op.control_inputs)) for op in graph.get_operations()}


@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_a_failure_midway_changes_no_existing_op(monkeypatch, failing_call):
    calls = {"n": 0}
    stock = compat.stock_gradients

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == failing_call:
            raise RuntimeError("injected")
        return stock(*args, **kwargs)

    stock_lookups = compat.gradient_capture_lookups()
    w = tf.Variable(np.linspace(0.5, 1.5, 16).reshape(4, 4).astype(np.float32))
    found = {}

    @tf.function(autograph=False)
    def step(x):
        hs = [x]
        for _ in range(6):
            y = tf.matmul(hs[-1], w)
            mean, variance = tf.nn.moments(y, [0])
            hs.append(tf.tanh((y - mean) * tf.math.rsqrt(variance + 1e-3)))
        loss = tf.reduce_sum(hs[-1] ** 2)
        graph = tf.compat.v1.get_default_graph()
        before = _snapshot(graph)
        monkeypatch.setattr(rewrite.compat, "stock_gradients", failing)
        with pytest.raises(RuntimeError, match="injected"):
            msg.gradients(loss, [w, x], checkpoints=hs[1:-1:2])
        monkeypatch.setattr(rewrite.compat, "stock_gradients", stock)
        after = _snapshot(graph)
        found["changed"] = [n for n in before if before[n] != after[n]]
        found["lookups"] = compat.gradient_capture_lookups()
        return msg.gradients(loss, [w, x], checkpoints=hs[1:-1:2]), tf.gradients(loss, [w, x])

    ours, theirs = step(tf.constant(np.linspace(-1, 1, 12).reshape(3, 4), tf.float32))
    assert calls["n"] >= failing_call
    assert found["changed"] == []
    assert found["lookups"] == stock_lookups
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
