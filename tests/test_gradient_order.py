"""The gradient ops that allocate scratch run one at a time (tfgraph/gradient_order.py).

With several inter-op threads TensorFlow ran a convolution's two gradient ops
(Conv2DBackpropInput, Conv2DBackpropFilter) side by side, and the step's peak
held both their scratch buffers. The rewrite chains them; these tests check
the chain in the graph and that gradients are unchanged.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import conv_gradients
from memory_saving_gradients.tfgraph import workspace
from memory_saving_gradients.tfgraph.workspace import SCRATCH_GRADIENT_OP_TYPES
from tests.harness import Context
from tests.harness import ancestors
from tests.harness import Model
from tests.harness import assert_matches_stock
from tests.harness import gradients_vs_stock
from tests.harness import waits_for

INPUTS = {"x": np.random.default_rng(0).normal(size=(4, 16, 16, 3)).astype(np.float32)}


def _normal(shape, seed):
    return np.random.default_rng(seed).normal(scale=0.3, size=shape).astype(np.float32)


def _cnn(ctx, x, blocks=4):
    """Conv-BN-ReLU blocks with a residual, a depthwise convolution and a max pool.

    The first two convolutions are strided with explicit padding: they keep
    TensorFlow's gradient kernels, which take scratch (SAME/VALID ones get
    conv_gradients' own).
    """
    h = x
    for i in range(blocks):
        w = ctx.variable(f"w{i}", _normal((3, 3, h.shape[-1], 8), seed=i))
        explicit = [[0, 0], [1, 1], [1, 1], [0, 0]]
        y = tf.nn.conv2d(h, w, 2, explicit) if i < 2 else tf.nn.conv2d(h, w, 1, "SAME")
        mean, variance = tf.nn.moments(y, [0, 1, 2])
        y = tf.nn.relu(tf.nn.batch_normalization(y, mean, variance, None, None, 1e-3))
        h = y + h if h.shape == y.shape else y
    d = ctx.variable("depthwise", _normal((3, 3, 8, 1), seed=9))
    h = tf.nn.max_pool2d(tf.nn.depthwise_conv2d(h, d, [1, 1, 1, 1], "SAME"), 2, 2, "SAME")
    return Model(ys=[tf.reduce_sum(h * h)], xs=[x] + list(ctx.variables.values()))


@pytest.mark.parametrize("mode", ["memory", "speed"])
def test_scratch_gradient_ops_run_in_one_order(mode):
    ctx = Context()
    found = {}

    @tf.function(autograph=False)
    def step(x):
        model = _cnn(ctx, x)
        # Not x: the first convolution's input gradient is needed by nobody.
        found["grads"] = msg.gradients(model.ys, model.xs[1:], checkpoints=mode)
        return found["grads"]

    graph = step.get_concrete_function(tf.TensorSpec(INPUTS["x"].shape)).graph
    needed = ancestors(found["grads"])
    scratch = [op for op in graph.get_operations() if op.type in SCRATCH_GRADIENT_OP_TYPES]
    chained = [op for op in scratch if op in needed]
    # 2 explicitly padded convolutions and a depthwise one (two gradient ops each) and a
    # max pool, less the first convolution's input gradient; and both gradient ops of
    # each SAME one whose stock kernels measure less scratch than ours would take
    # (`workspace.scratch_free_saves`: on these 4x4 images, by the host's kernels).
    assert len(chained) >= 6, [op.name for op in chained]
    # One chain: ordered by how many of the others each waits for, each waits for the one before.
    order = sorted(chained, key=lambda op: sum(waits_for(op, other) for other in chained))
    for first, later in zip(order, order[1:]):
        assert waits_for(later, first), (first.name, later.name)
    # A layer's weight gradient runs before its input gradient (which it would outlive).
    for op in chained:
        if op.type.endswith("BackpropInput"):
            weight = [w for w in chained if w is not op and compat.forward_op_of_gradient(w)
                      is compat.forward_op_of_gradient(op)]
            assert weight and all(waits_for(op, w) for w in weight), op.name
    # The unneeded input gradient stays out of the chain, so the executor skips it.
    unneeded = set(scratch) - needed
    assert [op.type for op in unneeded] == ["Conv2DBackpropInput"]
    for op in unneeded:
        assert not compat.control_outputs(op), op.name


@pytest.mark.parametrize("runtime", ["function", "session"])
def test_gradients_equal_stock_with_chained_scratch_ops(runtime):
    assert_matches_stock(gradients_vs_stock(runtime, _cnn, INPUTS), rtol=1e-4, atol=1e-4)


def test_without_scratch_only_each_layers_pair_is_ordered(monkeypatch):
    """On a host whose stock kernels take no scratch (oneDNN's), the ops are not
    chained across layers (that only cost parallelism), but a layer's weight
    gradient still runs before its input gradient."""
    monkeypatch.setattr(workspace, "stock_kernels_take_scratch", lambda: False)
    ctx = Context()
    found = {}

    @tf.function(autograph=False)
    def step(x):
        model = _cnn(ctx, x)
        found["grads"] = msg.gradients(model.ys, model.xs[1:], checkpoints="memory")
        found["stock"] = tf.gradients(model.ys, model.xs[1:])
        return found["grads"]

    # Larger images than INPUTS': on those no plan is predicted below tf.gradients' peak.
    graph = step.get_concrete_function(tf.TensorSpec([8, 32, 32, 3])).graph
    needed = ancestors(found["grads"])
    ours = [op for op in graph.get_operations()
            if op.type in SCRATCH_GRADIENT_OP_TYPES and op in needed
            and op not in ancestors(found["stock"])]
    pairs = 0
    for op in ours:
        forward = compat.forward_op_of_gradient(op)
        assert all(compat.forward_op_of_gradient(c) is forward for c in op.control_inputs
                   if c.type in SCRATCH_GRADIENT_OP_TYPES), op.name
        if op.type.endswith("BackpropInput"):
            weight = [w for w in ours if w is not op
                      and compat.forward_op_of_gradient(w) is forward]
            assert weight and all(waits_for(op, w) for w in weight), op.name
            pairs += 1
    assert pairs >= 4, [op.name for op in ours]


@pytest.mark.parametrize("runtime", ["function", "session"])
def test_gradients_equal_stock_without_scratch(runtime, monkeypatch):
    monkeypatch.setattr(workspace, "stock_kernels_take_scratch", lambda: False)
    assert_matches_stock(gradients_vs_stock(runtime, _cnn, INPUTS), rtol=1e-4, atol=1e-4)


def _conv(x, w, stride=1):
    # Explicit padding keeps TensorFlow's own gradient kernels (not conv_gradients').
    return tf.nn.conv2d(x, w, stride, [[0, 0], [1, 1], [1, 1], [0, 0]])


def _filter_from_activations(ctx, x, conv=_conv):
    """A convolution whose filter is computed from activations and whose image
    is a weight: its filter gradient carries the gradient on to the activations
    and its input gradient is a leaf, the roles the order usually sees reversed."""
    h = tf.nn.relu(conv(x, ctx.variable("w0", _normal((3, 3, 3, 3), seed=1))))
    h2 = tf.tanh(h) * 2.0
    shaped = tf.tanh(ctx.variable("wf", _normal((3, 3, 3, 3), seed=2)) * tf.reduce_mean(h2))
    image = ctx.variable("image", _normal((2, 4, 4, 3), seed=3))
    y = conv(image, shaped, 2)
    return Model(ys=[tf.reduce_sum(y * y) + tf.reduce_sum(h2)], xs=list(ctx.variables.values()))


def _hand_written_backprop(ctx, x):
    """Two-convolution blocks whose custom gradient builds the convolutions'
    backprop by hand (as reversible networks do): every op it makes records
    the same forward op, one IdentityN. Small images and many channels make
    each filter gradient larger than its input gradient."""

    @tf.custom_gradient
    def block(h, w1, w2):
        a = tf.nn.relu(_conv(h, w1))

        def grad(dy):
            def backprop(inp, w, out_backprop):
                args = dict(strides=[1, 1, 1, 1], padding="EXPLICIT",
                            explicit_paddings=[0, 0, 1, 1, 1, 1, 0, 0])
                return (tf.raw_ops.Conv2DBackpropInput(input_sizes=tf.shape(inp), filter=w,
                                                       out_backprop=out_backprop, **args),
                        tf.raw_ops.Conv2DBackpropFilter(input=inp, filter_sizes=tf.shape(w),
                                                        out_backprop=out_backprop, **args))
            da, dw2 = backprop(a, w2, dy)
            dh, dw1 = backprop(h, w1, da * tf.cast(a > 0, da.dtype))
            return dh, dw1, dw2
        return _conv(a, w2), grad

    h = tf.nn.relu(_conv(x, ctx.variable("w0", _normal((3, 3, 3, 32), seed=4))))
    for i in range(2):
        h = tf.nn.relu(block(h, ctx.variable(f"a{i}", _normal((3, 3, 32, 32), seed=5 + i)),
                             ctx.variable(f"b{i}", _normal((3, 3, 32, 32), seed=7 + i))))
    return Model(ys=[tf.reduce_sum(h * h)], xs=list(ctx.variables.values()))


def _scratch_free_filter_from_activations(ctx, x):
    """`_filter_from_activations` differentiated by conv_gradients' halves."""
    return _filter_from_activations(ctx, x, lambda x, w, stride=1: tf.nn.conv2d(x, w, stride,
                                                                                  "SAME"))


@pytest.mark.parametrize("build", [_filter_from_activations, _hand_written_backprop,
                                   _scratch_free_filter_from_activations])
@pytest.mark.parametrize("kernels_take_scratch", [True, False])
@pytest.mark.parametrize("mode", ["memory", "speed"])
def test_weight_gradient_first_makes_no_cycle(build, kernels_take_scratch, mode, monkeypatch):
    """The weight gradient goes before its input gradient only where no edge of
    the rewrite (the leaves' order included) already runs the other way: both
    models failed with "nodes in a cycle" when the swap was made before the
    leaves were ordered, or paired ops that only shared a forward op."""
    monkeypatch.setattr(workspace, "stock_kernels_take_scratch", lambda: kernels_take_scratch)
    monkeypatch.setattr(workspace, "scratch_free_saves", conv_gradients.is_eligible)
    ctx = Context()

    @tf.function(autograph=False)
    def both(x):
        model = build(ctx, x)
        return (msg.gradients(model.ys, model.xs, checkpoints=mode),
                tf.gradients(model.ys, model.xs))

    ours, stock = both(tf.constant(INPUTS["x"][:2, :4, :4]))
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["memory", "speed"])
def test_scratch_free_gradients_of_convolutions_run_one_at_a_time(mode, monkeypatch):
    """conv_gradients' halves (their tap slices and products are not scratch
    ops) join the chain: with several threads two convolutions' slices ran at
    once, VGG16's "memory" step (64 px) measuring 48.0 MiB of activations
    against 31.9 with one thread; chained, 44.9 with either, as predicted.
    A filter gradient smaller than its input gradient runs first."""
    monkeypatch.setattr(workspace, "stock_kernels_take_scratch", lambda: True)
    monkeypatch.setattr(workspace, "scratch_free_saves", conv_gradients.is_eligible)
    ctx = Context()
    found = {}

    @tf.function(autograph=False)
    def step(x):
        h = x
        for i, channels in enumerate([8, 8, 16, 16]):
            w = ctx.variable(f"w{i}", _normal((3, 3, h.shape[-1], channels), seed=i))
            h = tf.nn.relu(tf.nn.conv2d(h, w, 2 if i == 2 else 1, "SAME"))
        loss = tf.reduce_sum(h * h)
        found["grads"] = msg.gradients(loss, list(ctx.variables.values()), checkpoints=mode)
        return found["grads"], tf.gradients(loss, list(ctx.variables.values()))

    ours, stock = step(tf.constant(INPUTS["x"]))
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    graph = step.get_concrete_function(tf.TensorSpec(INPUTS["x"].shape)).graph
    needed = ancestors(found["grads"])
    halves = [op for op in graph.get_operations()
              if conv_gradients.half_of(op) is not None and op in needed]
    # Four filter gradients and three input gradients (the first convolution's is unneeded).
    assert sorted(conv_gradients.half_of(op).role for op in halves) == ["filter"] * 4 + [
        "input"] * 3
    order = sorted(halves, key=lambda op: sum(waits_for(op, other) for other in halves))
    for first, later in zip(order, order[1:]):
        # Every op of the later half, its gate first, waits for the one before.
        assert waits_for(conv_gradients.half_of(later).gate, first), (first.name, later.name)
    for op in halves:
        half = conv_gradients.half_of(op)
        pair = [o for o in halves if o is not op
                and conv_gradients.half_of(o).out_backprop is half.out_backprop]
        if half.role == "input":
            assert len(pair) == 1 and waits_for(half.gate, pair[0]), op.name
