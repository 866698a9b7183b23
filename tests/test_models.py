"""Our gradients equal stock tf.gradients, model by model.

Every test builds its model once per runtime (tf.compat.v1 Graph + Session,
and tf.function) with `gradients_vs_stock` from harness.py, which computes
stock tf.gradients and ours for 'memory', 'speed' and the model's explicit
checkpoint lists in the same graph and evaluates them in one run.
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

import memory_saving_gradients as msg
from harness import IndexedSlicesValue
from harness import Model
from harness import assert_matches_stock
from harness import control_flow_v1
from harness import gradients_vs_stock
from harness import recompute_copies
from harness import stock_gradients
from models import dense_layers
from models import normal


# --- chains -----------------------------------------------------------------

def test_tanh_chain(runtime):
    def build(ctx, x):
        hs = [x]
        for _ in range(12):
            hs.append(tf.tanh(hs[-1] * 1.1))
        y = tf.reduce_sum(hs[-1] * hs[-1])
        return Model(ys=[y], xs=[x], lists={
            "every_third": hs[3::3], "one": [hs[6]], "first_and_last": [hs[1], hs[-1]]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((4, 8))})
    assert_matches_stock(outcome)


def test_residual_chain(runtime):
    def build(ctx, x):
        ws = [ctx.variable(f"w{i}", normal((8, 8), 0.3, seed=i)) for i in range(6)]
        hs = [x]
        for w in ws:
            hs.append(hs[-1] + tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_mean(tf.square(hs[-1]))
        return Model(ys=[y], xs=[x] + ws, lists={
            "stream": hs[2::2], "branches": [h.op.inputs[1] for h in hs[1::2]]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((4, 8))})
    assert_matches_stock(outcome)


def test_mlp_with_resource_variables_as_xs(runtime):
    def build(ctx, x, labels):
        ws = dense_layers(ctx, [8, 16, 16, 16, 3])
        bs = [ctx.variable(f"b{i}", np.full([w.shape[1]], 0.1, np.float32))
              for i, w in enumerate(ws)]
        assert all(resource_variable_ops.is_resource_variable(w) for w in ws)
        hs = [x]
        for w, b in zip(ws[:-1], bs):
            hs.append(tf.nn.relu(tf.nn.bias_add(tf.matmul(hs[-1], w), b)))
        logits = tf.matmul(hs[-1], ws[-1]) + bs[-1]
        y = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        return Model(ys=[y], xs=ws + bs, lists={"hidden": hs[1:3]})

    outcome = gradients_vs_stock(runtime, build, {
        "x": normal((6, 8)), "labels": np.array([0, 1, 2, 0, 1, 2], np.int32)})
    assert_matches_stock(outcome)


# --- convolutions, batch norm -----------------------------------------------

MOMENTUM = 0.9


def _batch_norm(ctx, h, name):
    """Training-mode fused batch norm whose moving mean/variance update once per step."""
    channels = h.shape[-1]
    scale = ctx.variable(f"{name}_scale", np.ones([channels], np.float32))
    offset = ctx.variable(f"{name}_offset", np.zeros([channels], np.float32))
    mean = ctx.variable(f"{name}_moving_mean", np.zeros([channels], np.float32),
                        trainable=False)
    var = ctx.variable(f"{name}_moving_variance", np.ones([channels], np.float32),
                       trainable=False)
    out, batch_mean, batch_var = tf.compat.v1.nn.fused_batch_norm(
        h, scale, offset, is_training=True)
    updates = [mean.assign(mean * MOMENTUM + batch_mean * (1 - MOMENTUM)),
               var.assign(var * MOMENTUM + batch_var * (1 - MOMENTUM))]
    with tf.control_dependencies(updates):
        out = tf.identity(out)
    return out, [scale, offset], batch_mean, batch_var


def test_conv_net_with_batch_norm_updates_moving_statistics_once(runtime):
    def build(ctx, images):
        k1 = ctx.variable("k1", normal((3, 3, 2, 4), 0.3, seed=1))
        k2 = ctx.variable("k2", normal((3, 3, 4, 4), 0.3, seed=2))
        head = ctx.variable("head", normal((4, 2), 0.3, seed=3))
        c1 = tf.nn.conv2d(images, k1, 1, "SAME")
        n1, p1, m1, v1 = _batch_norm(ctx, c1, "bn1")
        a1 = tf.nn.relu(n1)
        c2 = tf.nn.conv2d(a1, k2, 1, "SAME")
        n2, p2, m2, v2 = _batch_norm(ctx, c2, "bn2")
        a2 = tf.nn.relu(n2) + a1
        pooled = tf.reduce_mean(a2, axis=[1, 2])
        y = tf.reduce_sum(tf.square(tf.matmul(pooled, head)))
        return Model(ys=[y], xs=[k1, k2, head] + p1 + p2,
                     lists={"relus": [a1, a2], "convs": [c1, c2]},
                     fetch={"m1": m1, "v1": v1, "m2": m2, "v2": v2})

    outcome = gradients_vs_stock(runtime, build, {"images": normal((2, 6, 6, 2))})
    assert_matches_stock(outcome, rtol=2e-5, atol=2e-6)
    # One step from zeros/ones: exactly one update, as tf.gradients alone gives.
    for bn in ("1", "2"):
        np.testing.assert_allclose(
            outcome.variables[f"bn{bn}_moving_mean"],
            (1 - MOMENTUM) * outcome.forward[f"m{bn}"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(
            outcome.variables[f"bn{bn}_moving_variance"],
            MOMENTUM + (1 - MOMENTUM) * outcome.forward[f"v{bn}"], rtol=1e-6, atol=1e-7)


def test_keras_batch_norm_in_tf_function_updates_moving_mean_once():
    import keras
    layer = keras.layers.BatchNormalization(momentum=MOMENTUM)
    conv = keras.layers.Conv2D(3, 3, padding="same", activation="tanh",
                               kernel_initializer=keras.initializers.GlorotUniform(seed=1))
    images = tf.constant(normal((2, 5, 5, 2)))
    conv.build(images.shape)
    layer.build((2, 5, 5, 3))

    @tf.function
    def step(grad_fn):
        h = conv(images)
        out = layer(h, training=True)
        y = tf.reduce_sum(tf.tanh(out) ** 2)
        weights = [w.value for w in conv.trainable_weights + layer.trainable_weights]
        return grad_fn(y, weights), tf.reduce_mean(h, axis=[0, 1, 2])

    def run(grad_fn):
        for w in layer.non_trainable_weights:
            w.assign(tf.zeros_like(w) if "mean" in w.path else tf.ones_like(w))
        grads, batch_mean = step(grad_fn)
        return [g.numpy() for g in grads], batch_mean.numpy(), layer.moving_mean.numpy()

    stock, batch_mean, stock_mean = run(stock_gradients)
    np.testing.assert_allclose(stock_mean, (1 - MOMENTUM) * batch_mean, rtol=1e-5, atol=1e-7)
    for mode in ("memory", "speed"):
        ours, _, ours_mean = run(lambda y, xs, mode=mode: msg.gradients(y, xs, checkpoints=mode))
        np.testing.assert_array_equal(ours_mean, stock_mean, err_msg=mode)
        for a, b in zip(stock, ours):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=mode)


# --- attention ----------------------------------------------------------------

def _layer_norm(h, gain, bias):
    mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
    return (h - mean) * tf.math.rsqrt(var + 1e-5) * gain + bias


def test_transformer_encoder_block(runtime):
    batch, seq, dim, heads = 2, 5, 8, 2

    def build(ctx, tokens):
        wq, wk, wv, wo = (ctx.variable(n, normal((dim, dim), dim ** -0.5, seed=i))
                          for i, n in enumerate(["wq", "wk", "wv", "wo"]))
        w1 = ctx.variable("w1", normal((dim, 2 * dim), dim ** -0.5, seed=5))
        w2 = ctx.variable("w2", normal((2 * dim, dim), (2 * dim) ** -0.5, seed=6))
        g1, b1, g2, b2 = (ctx.variable(n, np.full([dim], v, np.float32))
                          for n, v in [("g1", 1.0), ("b1", 0.0), ("g2", 1.0), ("b2", 0.0)])

        def split(h):  # [batch, seq, dim] -> [batch, heads, seq, dim/heads]
            return tf.transpose(tf.reshape(h, [batch, seq, heads, dim // heads]), [0, 2, 1, 3])

        q, k, v = (split(tf.einsum("bsd,de->bse", tokens, w)) for w in (wq, wk, wv))
        scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(dim // heads)
        attention = tf.nn.softmax(scores, axis=-1)
        context = tf.reshape(tf.transpose(tf.matmul(attention, v), [0, 2, 1, 3]),
                             [batch, seq, dim])
        h1 = _layer_norm(tokens + tf.einsum("bsd,de->bse", context, wo), g1, b1)
        ff = tf.einsum("bsf,fd->bsd", tf.nn.gelu(tf.einsum("bsd,df->bsf", h1, w1)), w2)
        h2 = _layer_norm(h1 + ff, g2, b2)
        y = tf.reduce_sum(tf.square(h2[:, 0]))
        return Model(ys=[y], xs=[tokens, wq, wk, wv, wo, w1, w2, g1, b1, g2, b2],
                     lists={"sublayers": [h1], "attention": [attention, context]})

    outcome = gradients_vs_stock(runtime, build, {"tokens": normal((batch, seq, dim))})
    assert_matches_stock(outcome, rtol=2e-5, atol=2e-6)


# --- sparse gradients ---------------------------------------------------------

@pytest.mark.parametrize("use", ["lookup", "gather_twice", "gather_and_dense",
                                 "gather_of_read"])
def test_embedding_gradient_is_sparse_exactly_when_stock_is(runtime, use):
    def build(ctx, ids, more_ids):
        table = ctx.variable("table", normal((10, 4), seed=1))
        w = ctx.variable("w", normal((4, 4), 0.5, seed=2))
        if use == "lookup":
            e = tf.nn.embedding_lookup(table, ids)
        elif use == "gather_twice":
            e = tf.gather(table, ids) + tf.gather(table, more_ids) * 0.5
        elif use == "gather_and_dense":
            e = tf.gather(table, ids) + tf.reduce_mean(table, axis=0)
        else:  # as Keras 3 Embedding does: GatherV2 on the variable's value
            e = tf.gather(table.value(), ids)
        hs = [e]
        for _ in range(4):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        return Model(ys=[y], xs=[table, w], lists={"middle": [hs[2]]})

    outcome = gradients_vs_stock(runtime, build, {
        "ids": np.array([1, 3, 3, 7, 0, 9], np.int32),
        "more_ids": np.array([2, 3, 5, 5, 8, 9], np.int32)})
    expect_sparse = use != "gather_and_dense"
    assert isinstance(outcome.stock[0], IndexedSlicesValue) == expect_sparse
    assert_matches_stock(outcome)


def test_sparse_gradient_of_an_activation(runtime):
    """An intermediate tensor read only by gathers gets IndexedSlices, as from tf.gradients."""
    def build(ctx, rows, ids):
        w = ctx.variable("w", normal((4, 4), 0.5, seed=2))
        table = tf.tanh(tf.matmul(rows, w))  # an activation used as a lookup table
        hs = [tf.gather(table, ids) * 2.0]
        for _ in range(4):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        # ids are integers: no gradient, from either.
        return Model(ys=[y], xs=[table, w, rows, ids],
                     lists={"middle": [hs[2]], "table": [table]})

    outcome = gradients_vs_stock(runtime, build, {
        "rows": normal((10, 4), seed=1), "ids": np.array([1, 3, 3, 7, 0, 9], np.int32)})
    assert [isinstance(g, IndexedSlicesValue) for g in outcome.stock[:3]] == [True, False, False]
    assert outcome.stock[3] is None
    assert_matches_stock(outcome)


# --- randomness -----------------------------------------------------------------

def test_dropout_mask_is_shared_never_recomputed(runtime):
    def build(ctx, x):
        ws = dense_layers(ctx, [8, 16, 16, 16, 4], scale=1.0)
        hs = [x]
        for w in ws:
            hs.append(tf.nn.dropout(tf.tanh(tf.matmul(hs[-1], w)), rate=0.5))
            hs.append(tf.sigmoid(hs[-1]))
        y = tf.reduce_sum(tf.square(hs[-1]))
        return Model(ys=[y], xs=[x] + ws, lists={"sigmoids": hs[2::4]})

    # A dynamic batch dimension puts the random ops inside the region.
    outcome = gradients_vs_stock(runtime, build, {"x": normal((6, 8))},
                                 shapes={"x": [None, 8]})
    assert_matches_stock(outcome, forward_unchanged=False)
    copies = recompute_copies(outcome)
    assert copies, "nothing was recomputed"
    assert not [c.name for c, _ in copies if c.op_def.is_stateful]


# --- conditionals -----------------------------------------------------------------

@pytest.mark.parametrize("flavour", ["v1", "v2"])
@pytest.mark.parametrize("take_true", [True, False])
def test_cond(runtime, flavour, take_true):
    if runtime != "session" and flavour == "v1":
        pytest.skip("tf.function always builds v2 control flow")

    def build(ctx, x, pred):
        w = ctx.variable("w", normal((4, 4), 0.5, seed=1))
        hs = [tf.tanh(tf.matmul(x, w))]
        hs.append(tf.sigmoid(hs[-1]) + hs[-1])
        branch = tf.cond(pred, lambda: tf.tanh(tf.matmul(hs[-1], w)) * 2.0,
                         lambda: tf.sigmoid(hs[-1]) * hs[0])
        hs.append(branch)
        for _ in range(3):
            hs.append(tf.tanh(hs[-1] * 1.5))
        y = tf.reduce_sum(hs[-1])
        return Model(ys=[y], xs=[x, w], lists={"before_and_after": [hs[1], hs[4]],
                                              "cond_output": [branch]})

    with control_flow_v1() if flavour == "v1" else contextlib.nullcontext():
        outcome = gradients_vs_stock(runtime, build, {
            "x": normal((3, 4)), "pred": np.array(take_true)})
    assert_matches_stock(outcome)


# --- dtypes ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(tf.float16, 2e-3), (tf.bfloat16, 1e-2)],
                         ids=["float16", "bfloat16"])
def test_mixed_precision(runtime, dtype, tol):
    def build(ctx, x):
        ws = dense_layers(ctx, [8, 16, 16, 16, 8])
        h = tf.cast(x, dtype)
        hs = []
        for w in ws:
            h = tf.tanh(tf.matmul(h, tf.cast(w, dtype)))
            hs.append(h)
            h = tf.cast(tf.sigmoid(tf.cast(h, tf.float32)) * 2.0, dtype)
        y = tf.reduce_sum(tf.square(tf.cast(h, tf.float32)))
        return Model(ys=[y], xs=[x] + ws, lists={"half": hs[::2]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((4, 8))})
    assert_matches_stock(outcome, rtol=tol, atol=tol)


# --- tf.gradients arguments ---------------------------------------------------------

def test_several_ys_with_grad_ys(runtime):
    def build(ctx, x, seed_a, seed_c):
        ws = dense_layers(ctx, [5, 5, 5, 5, 5])
        hs = [x]
        for w in ws:
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        ys = [hs[-1], hs[2], tf.reduce_sum(hs[3])]
        return Model(ys=ys, xs=[x] + ws, grad_ys=[seed_a, None, seed_c],
                     lists={"inner": [hs[1], hs[3]], "with_a_y": [hs[2], hs[3]]})

    outcome = gradients_vs_stock(runtime, build, {
        "x": normal((3, 5)), "seed_a": normal((3, 5), seed=7),
        "seed_c": np.float32(-2.0)})
    assert_matches_stock(outcome)


@pytest.mark.parametrize("unconnected", [None, "zero"])
def test_unconnected_xs(runtime, unconnected):
    def build(ctx, x, other):
        w = ctx.variable("w", normal((4, 4), 0.5, seed=1))
        unused = ctx.variable("unused", normal((4, 4), seed=2))
        hs = [x]
        for _ in range(5):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        side = tf.tanh(other)  # depends on an x, but no y depends on it
        kwargs = {} if unconnected is None else {"unconnected_gradients": unconnected}
        return Model(ys=[tf.reduce_sum(hs[-1])], xs=[x, unused, w, other, side],
                     kwargs=kwargs, lists={"mid": [hs[2]]})

    outcome = gradients_vs_stock(runtime, build, {
        "x": normal((2, 4)), "other": normal((3,), seed=3)})
    if unconnected is None:
        assert outcome.stock[1] is None and outcome.stock[3] is None
    else:
        assert outcome.stock[1].shape == (4, 4) and not outcome.stock[1].any()
    assert_matches_stock(outcome)


def _leaky_residual_stack(ctx, x, depth=8):
    """A variable w, the block outputs [x, h1, ..., h_depth], and a scalar loss."""
    w = ctx.variable("w", normal((6, 6), 0.5, seed=1))
    hs = [x]
    for _ in range(depth):
        hs.append(tf.tanh(tf.matmul(hs[-1], w)) + 0.5 * hs[-1])
    return w, hs, tf.reduce_sum(tf.square(hs[-1]))


def test_stop_gradients_pass_through(runtime):
    def build(ctx, x):
        w, hs, y = _leaky_residual_stack(ctx, x)
        return Model(ys=[y], xs=[x, w], kwargs={"stop_gradients": [hs[3], hs[6]]},
                     lists={"around_stops": [hs[2], hs[4], hs[7]], "at_stop": [hs[3]]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 6))})
    assert_matches_stock(outcome)


def test_intermediate_tensor_as_x(runtime):
    def build(ctx, x):
        w, hs, y = _leaky_residual_stack(ctx, x)
        # x and w twice: tf.gradients answers each entry; none counts twice.
        return Model(ys=[y], xs=[hs[4], x, w, hs[2], x, w, y],
                     lists={"around": [hs[3], hs[6]], "at_x": [hs[4]]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 6))})
    assert_matches_stock(outcome)


def test_gradients_called_twice_on_one_graph(runtime):
    def build(ctx, x):
        w = ctx.variable("w", normal((6, 6), 0.5, seed=1))
        hs = [x]
        for _ in range(8):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        # The same explicit list twice, after 'memory' and 'speed' already ran.
        return Model(ys=[y], xs=[x, w], lists={"first": hs[2::3], "again": hs[2::3]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 6))})
    assert len(outcome.ours) == 4
    assert_matches_stock(outcome)


def test_forward_ops_are_untouched_by_the_rewrite():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 6])
        w = tf.Variable(normal((6, 6), 0.5))
        hs = [x]
        for _ in range(6):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        before = {op.name: ([i.name for i in op.inputs], [c.name for c in op.control_inputs])
                  for op in graph.get_operations()}
        for mode in ("memory", "speed", hs[2::2]):
            msg.gradients(y, [x, w], checkpoints=mode)
        after = {op.name: ([i.name for i in op.inputs], [c.name for c in op.control_inputs])
                 for op in graph.get_operations() if op.name in before}
        assert after == before


def test_copies_keep_their_originals_device(runtime):
    def build(ctx, x):
        ws = dense_layers(ctx, [6, 6, 6, 6, 6, 6])
        with tf.device("/cpu:0"):
            hs = [x]
            for w in ws:
                hs.append(tf.tanh(tf.matmul(hs[-1], w)) * 1.5)
            y = tf.reduce_sum(hs[-1])
        return Model(ys=[y], xs=[x] + ws, lists={"list": hs[2::2]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 6))})
    assert_matches_stock(outcome)
    copies = recompute_copies(outcome)
    assert {"Tanh", "Mul"} <= {original.type for _, original in copies}
    for copy, original in copies:
        if original.type in ("Tanh", "Mul", "MatMul"):
            assert "CPU:0" in original.device, original.name
        assert copy.device == original.device, (copy.name, copy.device, original.device)


# --- op kinds ------------------------------------------------------------------------

def test_multi_output_and_shape_ops_with_dynamic_batch(runtime):
    def build(ctx, x):
        w = ctx.variable("w", normal((8, 8), 0.4, seed=1))
        h = tf.tanh(tf.matmul(x, w))
        a, b = tf.split(h, 2, axis=1)  # one op, two outputs
        h = tf.concat([tf.sigmoid(a) * b, tf.tanh(b)], axis=1)
        rows = tf.unstack(tf.reshape(h, [tf.shape(x)[0], 2, 4]), axis=1)
        h = tf.reshape(tf.stack([rows[1] * 2.0, tf.tanh(rows[0])], axis=1), tf.shape(x))
        mean, var = tf.nn.moments(h, axes=[0])
        h = tf.tanh((h - mean) * tf.math.rsqrt(var + 1e-3))
        index = tf.argmax(h, axis=1)
        picked = tf.gather(h, index, axis=1, batch_dims=1)
        h = h + tf.stop_gradient(h) * tf.expand_dims(picked, 1)
        y = tf.reduce_sum(tf.square(tf.matmul(h, w)))
        return Model(ys=[y], xs=[x, w], lists={"split": [a], "both_halves": [a, b],
                                              "rows": rows, "normalised": [h],
                                              "integer": [index, mean]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((5, 8))},
                                 shapes={"x": [None, 8]})
    assert_matches_stock(outcome)


def test_custom_gradient(runtime):
    @tf.custom_gradient
    def clipped_tanh(h):
        out = tf.tanh(h)

        def grad(dy):  # a deliberately different gradient: clipped, scaled
            return tf.clip_by_value(dy, -0.1, 0.1) * (1.0 - out * out) * 3.0
        return out, grad

    def build(ctx, x):
        w = ctx.variable("w", normal((6, 6), 0.5, seed=1))
        hs = [x]
        for i in range(6):
            h = tf.matmul(hs[-1], w)
            hs.append(clipped_tanh(h) if i % 2 else tf.sigmoid(h))
        y = tf.reduce_sum(tf.square(hs[-1]))
        return Model(ys=[y], xs=[x, w], lists={"even": hs[2::2], "odd": hs[1::2]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((3, 6))})
    assert_matches_stock(outcome)


@pytest.mark.parametrize("user_stop", [False, True])
@pytest.mark.parametrize("body", ["dense", "loop"])
def test_nested_tf_function_call(runtime, body, user_stop):
    """Calls of a tf.function inside the model: tf.gradients differentiates them
    even when told to stop at their outputs (by a SymbolicGradient op, which
    fails at run time on a loop in a function), and no gradient may count
    twice. A user's stop at a call output acts as it does for tf.gradients."""
    if body == "loop" and user_stop and runtime != "session":
        pytest.skip("tf.gradients itself fails at run time there (SymbolicGradient)")
    @tf.function(autograph=False)
    def block(h, w):
        if body == "loop":
            h = tf.while_loop(lambda t, h: t < 2, lambda t, h: (t + 1, tf.sin(h)), [0, h],
                              maximum_iterations=2)[1]
        return tf.tanh(tf.matmul(h, w)) * 1.5

    def build(ctx, x):
        w = ctx.variable("w", normal((6, 6), 0.4, seed=1))
        hs = [tf.sigmoid(x)]
        for i in range(6):
            hs.append(block(hs[-1], w) + hs[-1] if i % 2 else tf.sigmoid(hs[-1]) * hs[-1])
        # The loss reads a call's output directly too.
        y = tf.reduce_sum(tf.square(hs[-1])) + 0.5 * tf.reduce_sum(hs[2].op.inputs[0])
        return Model(ys=[y], xs=[x, w], lists={
            "residuals": hs[2::2], "calls": [h.op.inputs[0] for h in hs[2::2]],
            "products": hs[1::2]},
            kwargs={"stop_gradients": [hs[4].op.inputs[0]]} if user_stop else {})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 6))})
    assert {"PartitionedCall", "StatefulPartitionedCall"} & {
        op.type for op in outcome.graph.get_operations()}
    assert_matches_stock(outcome)


@pytest.mark.parametrize("kwargs", [
    {"gate_gradients": True},
    {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N},
    {"colocate_gradients_with_ops": True, "name": "my_gradients"},
], ids=["gate", "accumulate_n", "colocate_and_name"])
def test_tf_gradients_options_pass_through(runtime, kwargs):
    def build(ctx, x):
        ws = [ctx.variable(f"w{i}", normal((6, 6), 0.3, seed=i)) for i in range(4)]
        hs = [x]
        for w in ws:
            hs.append(hs[-1] + tf.tanh(tf.matmul(hs[-1], w)) * hs[-1])
        y = tf.reduce_sum(tf.square(hs[-1]))
        return Model(ys=[y], xs=[x] + ws, kwargs=kwargs, lists={"stream": hs[1:3]})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((3, 6))})
    assert_matches_stock(outcome)


def test_gradient_of_our_gradient(runtime):
    """A gradient penalty: stock tf.gradients differentiates through our rewrite."""
    def build(ctx, x):
        ws = [ctx.variable(f"w{i}", normal((5, 5), 0.4, seed=i)) for i in range(4)]
        hs = [x]
        for w in ws:
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        stock_dx = stock_gradients(y, x)[0]
        ours_dx = msg.gradients(y, x, checkpoints="memory")[0]
        return Model(ys=[y], xs=ws, fetch={
            "stock": tf.stack(stock_gradients(tf.reduce_sum(stock_dx ** 2), ws)),
            "ours": tf.stack(stock_gradients(tf.reduce_sum(ours_dx ** 2), ws))})

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 5))})
    # The fetches are gradients, not forward values: rounding may differ per graph.
    assert_matches_stock(outcome, forward_unchanged=False)
    np.testing.assert_allclose(outcome.forward["ours"], outcome.forward["stock"],
                               rtol=1e-5, atol=1e-6)
