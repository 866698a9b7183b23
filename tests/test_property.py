"""Property: on random DAGs, any explicit checkpoint list gives tf.gradients' values.

The DAGs mix elementwise ops (tanh, sigmoid, add, mul) with matmuls by
weight variables and calls of a tf.function; every node feeds a loss, so any
node is a valid checkpoint. Drawn too: an intermediate node as an extra x, a
node given as stop_gradients, one loss per sink or their sum, and the runtime
(Session or tf.function). Values are float64 so the comparison can be tight:
our gradients differ from stock only in the order partial gradients are summed.
"""

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from harness import RUNTIMES
from harness import Model
from harness import assert_matches_stock
from harness import gradients_vs_stock


@tf.function(autograph=False)
def _called(a, b):
    """A function call op (tf.gradients treats those specially)."""
    return tf.tanh(a) * b


UNARY = {"tanh": tf.tanh, "sigmoid": tf.sigmoid}
BINARY = {"add": tf.add, "mul": tf.multiply, "call": _called}
NUM_WEIGHTS = 3


@st.composite
def dags(draw):
    """A list of (op, input node indices) with node 0 the input x."""
    nodes = []
    for i in range(1, draw(st.integers(2, 12)) + 1):
        kind = draw(st.sampled_from(["tanh", "sigmoid", "add", "mul", "matmul", "call"]))
        first = draw(st.integers(0, i - 1))
        if kind in BINARY:
            nodes.append((kind, (first, draw(st.integers(0, i - 1)))))
        elif kind == "matmul":
            nodes.append((kind, (first, draw(st.integers(0, NUM_WEIGHTS - 1)))))
        else:
            nodes.append((kind, (first,)))
    return nodes


def _build_dag(nodes, checkpoints, x_node, stop_node, separate_ys):
    def build(ctx, x):
        weights = [ctx.variable(f"w{k}", np.random.RandomState(k).randn(3, 3) * 0.5)
                   for k in range(NUM_WEIGHTS)]
        hs = [x]
        for kind, args in nodes:
            if kind in UNARY:
                hs.append(UNARY[kind](hs[args[0]]))
            elif kind in BINARY:
                hs.append(BINARY[kind](hs[args[0]], hs[args[1]]))
            else:
                hs.append(tf.matmul(hs[args[0]], weights[args[1]]))
        consumed = {args[0] for _, args in nodes}
        consumed |= {args[1] for kind, args in nodes if kind in BINARY}
        sinks = [h for i, h in enumerate(hs) if i not in consumed]
        ys = [tf.reduce_sum(h * float(i + 1)) for i, h in enumerate(sinks)]
        xs = [x] + weights + ([hs[x_node]] if x_node else [])
        return Model(ys=ys if separate_ys else [tf.add_n(ys)], xs=xs,
                     kwargs={"stop_gradients": [hs[stop_node]]} if stop_node else {},
                     lists={"drawn": [hs[i] for i in checkpoints]})

    return build


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_dag_any_checkpoints_match_tf_gradients(data):
    nodes = data.draw(dags(), label="nodes")
    checkpoints = data.draw(st.sets(st.integers(0, len(nodes))), label="checkpoints")
    x_node = data.draw(st.none() | st.integers(1, len(nodes)), label="intermediate x")
    stop_node = data.draw(st.none() | st.integers(1, len(nodes)), label="stop_gradients")
    separate_ys = data.draw(st.booleans(), label="one y per sink")
    runtime = data.draw(st.sampled_from(RUNTIMES), label="runtime")
    x = np.random.RandomState(len(nodes)).randn(3, 3)
    build = _build_dag(nodes, sorted(checkpoints), x_node, stop_node, separate_ys)
    outcome = gradients_vs_stock(runtime, build, {"x": x}, modes=("memory", "speed"))
    assert_matches_stock(outcome, rtol=1e-9, atol=1e-12)
