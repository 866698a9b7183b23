"""Property: on random models, any explicit checkpoint list gives tf.gradients' values.

Hypothesis draws a DAG of blocks over [4, 8] float64 tensors from the op
vocabulary real models use (see `BLOCKS`): elementwise ops and matmuls,
multi-output ops, reshapes and slices, gathers (IndexedSlices) with integer
indices computed from the data, tf.where, moments, softmax, convolutions and
pooling, fused batch norm, casts to float16/bfloat16, stop_gradient, a
clipping custom_gradient, nested tf.function calls, v2 cond/case and while
loops (with TensorArrays, reading variables, nested), stateful and stateless
random ops. Drawn too: the xs (input, weights, intermediates, an unconnected
variable), one or several ys with grad_ys, checkpoint lists mixing any
tensors (xs, ys, integer tensors, multi-output siblings), stop_gradients,
second-order gradients and the runtime (Session, tf.function). XLA runs the
same in a subprocess, since XLA can abort the process.

Default: a few tens of examples (a few minutes on 2 cores). The long
profile: MSG_PROPERTY_PROFILE=long (see docs/testing.md).
"""

import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck
import hypothesis
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import max_pool_grad_grad
from harness import Model
from harness import assert_matches_stock
from harness import gradients_vs_stock
from harness import stock_gradients

settings.register_profile("default", max_examples=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("MSG_PROPERTY_PROFILE", "default"))
_XLA_CHILD = "MSG_PROPERTY_XLA_CHILD"

WIDTH = 8


@tf.function(autograph=False)
def _called(a, b):
    """A function call op (tf.gradients treats those specially)."""
    return tf.tanh(a) * b


@tf.custom_gradient
def _clip_gradient(h):
    """Identity whose gradient is clipped: not linear in the incoming gradient."""
    return tf.identity(h), lambda dy: tf.clip_by_value(dy, -0.2, 0.2)


def _image(h):
    return tf.reshape(h, [-1, 2, WIDTH // 2, 1])


def _flat(h):
    return tf.reshape(h, [-1, WIDTH])


def _split(h, w):
    a, b = tf.split(h, 2, axis=1)
    return tf.concat([tf.tanh(a) * b, a], axis=1)


def _gather_rows(h, w):
    """Rows chosen by an integer tensor computed from the data: IndexedSlices."""
    rows = tf.math.floormod(tf.argmax(h, axis=1, output_type=tf.int32), WIDTH)
    return tf.gather(w, rows) * h + tf.gather(h, [3, 0, 1, 2])


def _moments(h, w):
    mean, variance = tf.nn.moments(h, axes=[1], keepdims=True)
    return (h - mean) * tf.math.rsqrt(variance + 1e-3)


def _fused_batch_norm(h, w):
    x = tf.cast(_image(h), tf.float32)
    y = tf.compat.v1.nn.fused_batch_norm(x, tf.ones([1]), tf.zeros([1]), is_training=True)[0]
    return tf.cast(_flat(y), tf.float64)


def _loop(h, w):
    """Two steps reading `w` in the body, writing a TensorArray."""
    def body(t, state, outs):
        state = tf.tanh(tf.matmul(state, w))
        return t + 1, state, outs.write(t, state)
    _, last, outs = tf.while_loop(
        lambda t, s, o: t < 2, body, [0, h, tf.TensorArray(tf.float64, 2)],
        maximum_iterations=2)
    return last + tf.reduce_mean(outs.stack(), axis=0)


def _nested_loop(h, w):
    def body(t, state):
        inner = tf.while_loop(lambda u, s: u < 2, lambda u, s: (u + 1, tf.sin(s) * 0.9),
                              [0, state], maximum_iterations=2)[1]
        return t + 1, tf.tanh(tf.matmul(inner, w))
    return tf.while_loop(lambda t, s: t < 2, body, [0, h], maximum_iterations=2)[1]


def _case(h, w):
    index = tf.math.floormod(tf.cast(tf.reduce_sum(h) > 0, tf.int32) + 1, 3)
    return tf.switch_case(index, [lambda: tf.tanh(h), lambda: tf.sin(h) * 2.0,
                                  lambda: tf.matmul(h, w)])


# name -> (arity, function of (*inputs, weight)). Every block maps [4, 8]
# float64 tensors to one.
BLOCKS = {
    "tanh": (1, lambda h, w: tf.tanh(h)),
    "sigmoid": (1, lambda h, w: tf.sigmoid(h)),
    "add": (2, lambda a, b, w: a + b),
    "mul": (2, lambda a, b, w: a * b),
    "matmul": (1, lambda h, w: tf.matmul(h, w)),
    "call": (2, lambda a, b, w: _called(a, b)),
    "split": (1, _split),
    "unstack": (1, lambda h, w: tf.stack(tf.unstack(h)[::-1]) * h),
    "top_k": (1, lambda h, w: tf.math.top_k(h, k=WIDTH).values * h),
    "reshape": (1, lambda h, w: _flat(tf.transpose(tf.reshape(h, [4, 2, 4]), [0, 2, 1]))),
    "slice": (1, lambda h, w: tf.concat([h[:, 3:], tf.sin(h[:, :3])], axis=1)),
    "gather": (1, _gather_rows),
    "where": (1, lambda h, w: tf.where(h > 0, h, 0.1 * h)),
    "moments": (1, _moments),
    "softmax": (1, lambda h, w: tf.nn.softmax(h) * 3.0),
    "conv": (1, lambda h, w: _flat(tf.nn.conv2d(_image(h), tf.reshape(w[:3, :3], [3, 3, 1, 1]),
                                                1, "SAME"))),
    "max_pool": (1, lambda h, w: _flat(tf.nn.max_pool2d(_image(h), 2, 1, "SAME"))),
    "avg_pool": (1, lambda h, w: _flat(tf.nn.avg_pool2d(_image(h), 2, 1, "SAME"))),
    "batch_norm": (1, _fused_batch_norm),
    "float16": (1, lambda h, w: tf.cast(tf.tanh(tf.cast(h, tf.float16)), tf.float64)),
    "bfloat16": (1, lambda h, w: tf.cast(tf.sigmoid(tf.cast(h, tf.bfloat16)), tf.float64)),
    "stop_gradient": (1, lambda h, w: h * tf.stop_gradient(tf.tanh(h))),
    "custom_gradient": (1, lambda h, w: _clip_gradient(h * 2.0)),
    "cond": (1, lambda h, w: tf.cond(tf.reduce_sum(h) > 0, lambda: tf.tanh(h),
                                     lambda: tf.matmul(h, w))),
    "case": (1, _case),
    "loop": (1, _loop),
    "nested_loop": (1, _nested_loop),
    "dropout": (1, lambda h, w: tf.nn.dropout(h, rate=0.5)),
    "stateless_random": (1, lambda h, w: h * tf.random.stateless_uniform(
        [4, WIDTH], seed=[1, 2], dtype=tf.float64)),
}
_LOW_PRECISION = {"float16": 1e-2, "bfloat16": 5e-2}
_RANDOM = {"dropout"}
# Blocks computing in float32 inside the float64 model (the fused batch norm
# kernel has no float64): second orders that add the same terms in another
# order (ours keeps a recomputed copy's contributions apart) differ by float32 rounding.
_FLOAT32_INSIDE = {"batch_norm"}
NUM_WEIGHTS = 2


@st.composite
def dags(draw):
    """A list of (block name, input node indices, weight index); node 0 is x."""
    nodes = []
    for i in range(1, draw(st.integers(2, 9)) + 1):
        kind = draw(st.sampled_from(sorted(BLOCKS)))
        inputs = tuple(draw(st.integers(0, i - 1)) for _ in range(BLOCKS[kind][0]))
        nodes.append((kind, inputs, draw(st.integers(0, NUM_WEIGHTS - 1))))
    return nodes


@st.composite
def problems(draw):
    """A model and how to differentiate it."""
    nodes = draw(dags(), label="nodes")
    n = len(nodes)
    second_order = draw(st.booleans(), label="second order")
    stop_node = draw(st.none() | st.integers(1, n), label="stop_gradients")
    if second_order and stop_node and nodes[stop_node - 1][0] == "call":
        stop_node = None  # tf.gradients itself has no second order there (SymbolicGradient)
    return dict(
        nodes=nodes, second_order=second_order, stop_node=stop_node,
        checkpoints=sorted(draw(st.sets(st.integers(0, n)), label="checkpoints")),
        extra=draw(st.sets(st.sampled_from(["indices", "sibling", "x", "y"])),
                   label="extra checkpoints"),
        x_nodes=sorted(draw(st.sets(st.integers(1, n), max_size=2), label="intermediate xs")),
        unconnected=draw(st.booleans(), label="unconnected x"),
        separate_ys=draw(st.booleans(), label="one y per sink"),
        grad_ys=draw(st.booleans(), label="grad_ys"))


def _forward(nodes, x, weights):
    """Node tensors, and tensors of special kinds met on the way."""
    hs = [x]
    for kind, inputs, weight in nodes:
        hs.append(BLOCKS[kind][1](*[hs[i] for i in inputs], weights[weight]))
    return hs


def _special_tensors(graph_ops):
    """An integer tensor and a multi-output sibling among the model's ops, if any."""
    ints = [t for op in graph_ops for t in op.outputs if t.dtype == tf.int32
            and op.type in ("ArgMax", "FloorMod")]
    siblings = [op.outputs[1] for op in graph_ops if op.type == "Split"]
    return {"indices": ints[-1:], "sibling": siblings[-1:]}


def _build(problem):
    nodes = problem["nodes"]

    def build(ctx, x):
        weights = [ctx.variable(f"w{k}", np.random.RandomState(k).randn(WIDTH, WIDTH) * 0.4)
                   for k in range(NUM_WEIGHTS)]
        unused = ctx.variable("unused", np.ones([WIDTH]))
        before = len(tf.compat.v1.get_default_graph().get_operations())
        hs = _forward(nodes, x, weights)
        made = tf.compat.v1.get_default_graph().get_operations()[before:]
        consumed = {i for _, inputs, _ in nodes for i in inputs}
        sinks = [h for i, h in enumerate(hs) if i not in consumed]
        ys = [tf.reduce_sum(h * float(i + 1)) for i, h in enumerate(sinks)]
        ys = ys if problem["separate_ys"] else [tf.add_n(ys)]
        xs = [x] + weights + [hs[i] for i in problem["x_nodes"]]
        xs += [unused] if problem["unconnected"] else []
        special = _special_tensors(made)
        listed = [hs[i] for i in problem["checkpoints"]]
        for extra in sorted(problem["extra"]):
            listed += {"x": [hs[i] for i in problem["x_nodes"][:1]], "y": ys[:1]}.get(
                extra, special.get(extra, []))
        grad_ys = ([tf.constant(1.5 + i, tf.float64) for i in range(len(ys))]
                   if problem["grad_ys"] else None)
        kwargs = {"stop_gradients": [hs[problem["stop_node"]]]} if problem["stop_node"] else {}
        fetch = _second_order(ys, xs, grad_ys, listed, kwargs) if problem["second_order"] else {}
        return Model(ys=ys, xs=xs, grad_ys=grad_ys, kwargs=kwargs, fetch=fetch,
                     lists={"drawn": listed})

    return build


def _second_order(ys, xs, grad_ys, listed, kwargs):
    """Gradients of a penalty on the first-order gradients, stock vs ours.

    Both second orders are tf.gradients with the max pool's gradient
    (`MaxPoolGrad`, stride 1 SAME: output shaped as input) differentiated as
    memory_saving_gradients does it: TensorFlow's CPU `MaxPoolGradGrad` kernel
    returns zeros when it takes its input's buffer as its output, which
    depends on the schedule (max_pool_grad_grad.py). With the stock gradient
    one side or the other came out zero: ~2-3% of examples failed.
    """
    fetch = {}
    for name, first in [("stock", stock_gradients(ys, xs, grad_ys, **kwargs)),
                        ("ours", msg.gradients(ys, xs, grad_ys, checkpoints=listed, **kwargs))]:
        dense = [tf.convert_to_tensor(g) for g in first if g is not None]
        penalty = tf.add_n([tf.reduce_sum(tf.square(g)) for g in dense]) if dense else None
        seconds = []
        if penalty is not None:
            with max_pool_grad_grad.argmax_gradients(penalty.graph.get_operations()):
                seconds = stock_gradients(penalty, xs[:3])
        fetch.update({f"{name}_second{i}": tf.convert_to_tensor(g)
                      for i, g in enumerate(seconds) if g is not None})
    return fetch


_POOLING = frozenset({"max_pool", "avg_pool"})


def _check(problem, runtime):
    kinds = {kind for kind, _, _ in problem["nodes"]}
    tolerance = max([1e-9] + [_LOW_PRECISION[k] for k in kinds if k in _LOW_PRECISION])
    if runtime == "xla" and kinds & _FLOAT32_INSIDE:
        # XLA fuses the float32 batch norm with other neighbours in our graph than
        # in stock's: first orders then differ by float32 rounding too (a drawn
        # example: x's gradient 1e-7 relative apart, stock and ours alike on main).
        tolerance = max(tolerance, 1e-5)
    x = np.random.RandomState(len(problem["nodes"])).randn(4, WIDTH)
    outcome = gradients_vs_stock(runtime, _build(problem), {"x": x}, modes=("memory", "speed"))
    random = bool(kinds & _RANDOM)
    second = max(tolerance, 1e-5 if kinds & _FLOAT32_INSIDE else 1e-7)

    # Under XLA the same second-order ops, compiled again with the modes'
    # gradients added beside them, are fused and summed in another order; with
    # a float32 batch norm inside, a drawn example's entry of -0.0071 moved
    # 5.3e-7 among entries up to 0.08 (session 66's CI), above the 1e-6 of the
    # largest entry allowed without XLA; 1e-5 of it there. Compared with
    # stock's second order below, it stays within `second`.
    spread = 10 * second if runtime == "xla" and kinds & _FLOAT32_INSIDE else second

    def forward_tolerance(name, value):
        # A second order run again beside our gradients' ops is summed in
        # another order: in float16, by about one rounding of its largest terms.
        if "_second" in name:
            return second, _second_order_atol(value, spread)
        return tolerance, tolerance * 1e-3

    assert_matches_stock(outcome, rtol=tolerance, atol=tolerance * 1e-3,
                         forward_unchanged=not random, forward_tolerance=forward_tolerance)
    for name in outcome.forward:
        if name.startswith("ours_second"):
            ours, stock = outcome.forward[name], outcome.forward[name.replace("ours", "stock")]
            if second > 1e-7:
                # Stock's float16 sums overflow (inf, nan) where ours, added in
                # float64, may not: compare where stock is finite (ours must be too).
                ours, stock = ours[np.isfinite(stock)], stock[np.isfinite(stock)]
            np.testing.assert_allclose(ours, stock, rtol=second,
                                       atol=_second_order_atol(stock, second), err_msg=name)


def _second_order_atol(stock, tolerance):
    """Absolute tolerance of a second-order gradient: in low precision, a share of its scale.

    Where our first-order gradient reads a recomputed copy of a float16 tensor,
    stock's second order meets two contributions to that tensor in a float16
    AddN, ours in float64 after each is cast back. Terms of a few hundred then
    differ by one float16 rounding (0.03 to 0.3), and an entry where such terms
    cancel can be near zero: the error follows the terms, not the entry.
    """
    atol = max(tolerance, 1e-7) * 1e-3
    finite = np.abs(stock[np.isfinite(stock)])
    if tolerance > 1e-7 and finite.size:  # about one low-precision epsilon of the largest entry
        atol = max(atol, 0.1 * tolerance * finite.max())
    return atol


# The same draws in every run (derandomize): a failing CI blocks every change
# (session 36's CI drew the example below, a wrong second order then). More
# draws: MSG_PROPERTY_PROFILE=long.
@settings(derandomize=True)
@given(problem=problems(), runtime=st.sampled_from(["session", "function"]))
def test_random_models_any_checkpoints_match_tf_gradients(problem, runtime):
    _check(problem, runtime)


def test_second_order_through_a_clipping_custom_gradient_and_an_intermediate_x():
    """A drawn example (session 36's CI), 1.7e-3 relative from stock before
    session 37: the x after the batch norm is differentiated through its own
    op, so a second order met the clipping custom gradient's original and its
    copy, and clipped their parts apart (15% apart with a float64 batch norm).
    Such ops are kept now (`gradient_linearity`)."""
    problem = dict(
        nodes=[("custom_gradient", (0,), 0), ("avg_pool", (0,), 0), ("avg_pool", (0,), 0),
               ("batch_norm", (1,), 0), ("mul", (0, 4), 0)],
        second_order=True, stop_node=None, checkpoints=[], extra=set(),
        x_nodes=[4], unconnected=False, separate_ys=False, grad_ys=False)
    _check(problem, "session")


def test_second_order_float16_sums_differ_by_rounding_only():
    """A drawn example that failed one run in ~25: dropout, seeded here, picks the failing mask.

    Its second order sums terms of a few hundred into a float16 tensor (stock: in
    float16, ours: in float64), and they cancel at one entry of x's gradient.
    """
    problem = dict(
        nodes=[("loop", (0,), 0), ("float16", (0,), 1), ("gather", (1,), 0), ("avg_pool", (1,), 0),
               ("call", (3, 2), 0), ("top_k", (1,), 1), ("top_k", (0,), 1), ("avg_pool", (2,), 0),
               ("dropout", (7,), 0)],
        second_order=True, stop_node=None, checkpoints=list(range(10)), extra={"indices", "y"},
        x_nodes=[4, 5], unconnected=False, separate_ys=True, grad_ys=False)
    seeded = (1, lambda h, w: tf.nn.experimental.stateless_dropout(h, rate=0.5, seed=[2, 0]))
    with mock.patch.dict(BLOCKS, {"dropout": seeded}):
        _check(problem, "session")


def test_second_order_float16_overflow_of_stock_is_not_compared():
    """A drawn example whose second order overflows float16 in stock's sums
    (inf/nan entries) but not in ours, which adds in float64."""
    problem = dict(
        nodes=[("mul", (0, 0), 0), ("add", (1, 1), 0), ("float16", (1,), 0), ("mul", (0, 0), 0),
               ("top_k", (0,), 0), ("tanh", (4,), 0), ("case", (3,), 0), ("case", (3,), 0)],
        second_order=True, stop_node=5, checkpoints=[4], extra=set(), x_nodes=[5],
        unconnected=False, separate_ys=True, grad_ys=True)
    _check(problem, "session")


def test_second_order_in_float16_run_beside_our_gradients_differs_by_rounding_only():
    """A drawn example (session 37, the long profile): our second order, run
    again in the graph holding our gradients' ops too, came out 0.09 from its
    first run at an entry of 4.2 among entries of 214 (float16 sums)."""
    problem = dict(
        nodes=[("matmul", (0,), 0), ("float16", (1,), 0), ("stateless_random", (2,), 0),
               ("matmul", (0,), 0), ("matmul", (2,), 0), ("softmax", (5,), 0), ("case", (6,), 1)],
        second_order=True, stop_node=6, checkpoints=[4], extra=set(), x_nodes=[],
        unconnected=True, separate_ys=True, grad_ys=False)
    _check(problem, "function")


def test_second_order_through_float32_batch_norm_differs_by_rounding_only():
    """A drawn example: the fused batch norm computes in float32, and its second
    order differed from stock's by 9e-7 relative (float32 rounding)."""
    problem = dict(
        nodes=[("reshape", (0,), 0), ("batch_norm", (0,), 0), ("avg_pool", (0,), 0),
               ("max_pool", (0,), 0), ("reshape", (4,), 0), ("unstack", (0,), 0),
               ("case", (2,), 0), ("moments", (0,), 0), ("sigmoid", (2,), 0)],
        second_order=True, stop_node=None, checkpoints=[], extra={"indices", "sibling"},
        x_nodes=[1], unconnected=True, separate_ys=False, grad_ys=True)
    _check(problem, "session")


def test_second_order_through_stride_one_same_max_pool_is_not_a_race():
    """A drawn example that failed 9 runs in 20 before `_second_order` avoided
    TensorFlow's CPU MaxPoolGradGrad: it zeroed its part of stock's or of
    our side's second order, whichever the schedule let it forward its input
    buffer in (max_pool_grad_grad.py)."""
    problem = dict(
        nodes=[("max_pool", (0,), 1), ("conv", (1,), 1), ("slice", (1,), 0), ("case", (0,), 1),
               ("float16", (1,), 0)],
        second_order=True, stop_node=5, checkpoints=[0, 1], extra=set(), x_nodes=[],
        unconnected=False, separate_ys=False, grad_ys=False)
    for _ in range(5):
        _check(problem, "function")


@pytest.mark.skipif(not os.environ.get(_XLA_CHILD), reason="run by the XLA test, in a subprocess")
@settings(max_examples=max(5, settings.default.max_examples // 4), derandomize=True)
@given(problem=problems())
@hypothesis.example(problem=dict(  # drawn in session 66's CI: see `spread` in _check
    nodes=[("sigmoid", (0,), 0), ("loop", (0,), 0), ("unstack", (0,), 0),
           ("batch_norm", (3,), 0)],
    second_order=True, stop_node=2, checkpoints=[0, 1, 2, 3, 4], extra={"x", "indices"},
    x_nodes=[], unconnected=True, separate_ys=True, grad_ys=True))
def test_random_models_under_xla_in_this_process(problem):
    kinds = {kind for kind, _, _ in problem["nodes"]}
    # Stock tf.gradients itself fails there: XLA cannot compile the second-order
    # gradients of pooling ops ("tf2xla conversion failed" in the stock-only step).
    hypothesis.assume(not (problem["second_order"] and kinds & _POOLING))
    _check(problem, "xla")


def test_random_models_under_xla():
    """The XLA examples, in a child process: XLA may abort a process on failure."""
    node_id = f"{__file__}::test_random_models_under_xla_in_this_process"
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node_id],
        env={**os.environ, _XLA_CHILD: "1"}, capture_output=True, text=True, timeout=1500)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
