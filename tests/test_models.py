"""Our gradients equal stock tf.gradients, model by model.

Every test builds its model once per runtime (tf.compat.v1 Graph + Session,
and tf.function) with `gradients_vs_stock` from conftest.py, which computes
stock tf.gradients and ours for 'memory', 'speed' and the model's explicit
checkpoint lists in the same graph and evaluates them in one run.
"""

import contextlib
import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

import memory_saving_gradients as msg
from conftest import IndexedSlicesValue
from conftest import Context
from conftest import Model
from conftest import assert_matches_stock
from conftest import control_flow_v1
from conftest import gradients_vs_stock
from conftest import recompute_copies
from conftest import stock_gradients


def _rng(seed=0):
    return np.random.RandomState(seed)


def _normal(shape, scale=1.0, seed=0, dtype=np.float32):
    return (_rng(seed).randn(*shape) * scale).astype(dtype)


def _dense_layers(ctx, sizes, prefix="w", scale=0.5):
    return [ctx.variable(f"{prefix}{i}", _normal((a, b), scale / np.sqrt(a), seed=i + 1))
            for i, (a, b) in enumerate(zip(sizes, sizes[1:]))]


# --- chains -----------------------------------------------------------------

def test_tanh_chain(runtime):
    def build(ctx, x):
        hs = [x]
        for _ in range(12):
            hs.append(tf.tanh(hs[-1] * 1.1))
        y = tf.reduce_sum(hs[-1] * hs[-1])
        return Model(ys=[y], xs=[x], lists={
            "every_third": hs[3::3], "one": [hs[6]], "first_and_last": [hs[1], hs[-1]]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((4, 8))})
    assert_matches_stock(outcome)


def test_residual_chain(runtime):
    def build(ctx, x):
        ws = [ctx.variable(f"w{i}", _normal((8, 8), 0.3, seed=i)) for i in range(6)]
        hs = [x]
        for w in ws:
            hs.append(hs[-1] + tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_mean(tf.square(hs[-1]))
        return Model(ys=[y], xs=[x] + ws, lists={
            "stream": hs[2::2], "branches": [h.op.inputs[1] for h in hs[1::2]]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((4, 8))})
    assert_matches_stock(outcome)


def test_mlp_with_resource_variables_as_xs(runtime):
    def build(ctx, x, labels):
        ws = _dense_layers(ctx, [8, 16, 16, 16, 3])
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
        "x": _normal((6, 8)), "labels": np.array([0, 1, 2, 0, 1, 2], np.int32)})
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
        k1 = ctx.variable("k1", _normal((3, 3, 2, 4), 0.3, seed=1))
        k2 = ctx.variable("k2", _normal((3, 3, 4, 4), 0.3, seed=2))
        head = ctx.variable("head", _normal((4, 2), 0.3, seed=3))
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

    outcome = gradients_vs_stock(runtime, build, {"images": _normal((2, 6, 6, 2))})
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
    images = tf.constant(_normal((2, 5, 5, 2)))
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
        wq, wk, wv, wo = (ctx.variable(n, _normal((dim, dim), dim ** -0.5, seed=i))
                          for i, n in enumerate(["wq", "wk", "wv", "wo"]))
        w1 = ctx.variable("w1", _normal((dim, 2 * dim), dim ** -0.5, seed=5))
        w2 = ctx.variable("w2", _normal((2 * dim, dim), (2 * dim) ** -0.5, seed=6))
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

    outcome = gradients_vs_stock(runtime, build, {"tokens": _normal((batch, seq, dim))})
    assert_matches_stock(outcome, rtol=2e-5, atol=2e-6)


# --- sparse gradients ---------------------------------------------------------

@pytest.mark.parametrize("use", ["lookup", "gather_twice", "gather_and_dense",
                                 "gather_of_read"])
def test_embedding_gradient_is_sparse_exactly_when_stock_is(runtime, use):
    def build(ctx, ids, more_ids):
        table = ctx.variable("table", _normal((10, 4), seed=1))
        w = ctx.variable("w", _normal((4, 4), 0.5, seed=2))
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
        w = ctx.variable("w", _normal((4, 4), 0.5, seed=2))
        table = tf.tanh(tf.matmul(rows, w))  # an activation used as a lookup table
        hs = [tf.gather(table, ids) * 2.0]
        for _ in range(4):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        # ids are integers: no gradient, from either.
        return Model(ys=[y], xs=[table, w, rows, ids],
                     lists={"middle": [hs[2]], "table": [table]})

    outcome = gradients_vs_stock(runtime, build, {
        "rows": _normal((10, 4), seed=1), "ids": np.array([1, 3, 3, 7, 0, 9], np.int32)})
    assert [isinstance(g, IndexedSlicesValue) for g in outcome.stock[:3]] == [True, False, False]
    assert outcome.stock[3] is None
    assert_matches_stock(outcome)


# --- randomness -----------------------------------------------------------------

def test_dropout_mask_is_shared_never_recomputed(runtime):
    def build(ctx, x):
        ws = _dense_layers(ctx, [8, 16, 16, 16, 4], scale=1.0)
        hs = [x]
        for w in ws:
            hs.append(tf.nn.dropout(tf.tanh(tf.matmul(hs[-1], w)), rate=0.5))
            hs.append(tf.sigmoid(hs[-1]))
        y = tf.reduce_sum(tf.square(hs[-1]))
        return Model(ys=[y], xs=[x] + ws, lists={"sigmoids": hs[2::4]})

    # A dynamic batch dimension puts the random ops inside the region.
    outcome = gradients_vs_stock(runtime, build, {"x": _normal((6, 8))},
                                 shapes={"x": [None, 8]})
    assert_matches_stock(outcome, forward_unchanged=False)
    copies = recompute_copies(outcome)
    assert copies, "nothing was recomputed"
    assert not [c.name for c, _ in copies if c.op_def.is_stateful]


# --- control flow -----------------------------------------------------------------

def _rnn_model(ctx, x, steps=4):
    """tanh RNN over x[:, t] in a tf.while_loop, with layers before and after it.

    Each step runs an inner while loop and writes its state to a TensorArray,
    as dynamic_rnn does.
    """
    w_in = ctx.variable("w_in", _normal((3, 6), 0.5, seed=1))
    w_rec = ctx.variable("w_rec", _normal((6, 6), 0.4, seed=2))
    w_out = ctx.variable("w_out", _normal((6, 6), 0.4, seed=3))
    pre = [tf.tanh(tf.einsum("btc,ch->bth", x, w_in))]
    pre.append(tf.sigmoid(pre[-1]) * pre[-1])
    inputs = pre[-1]

    def body(t, h, states):
        h = tf.tanh(tf.matmul(h, w_rec) + inputs[:, t])
        _, h = tf.while_loop(lambda i, g: i < 2, lambda i, g: (i + 1, tf.sin(g) + h),
                             [tf.constant(0), h])
        return t + 1, h, states.write(t, h)

    _, last, states = tf.while_loop(
        lambda t, h, states: t < steps, body,
        [tf.constant(0), tf.zeros([x.shape[0], 6]), tf.TensorArray(tf.float32, steps)])
    post = [last + tf.reduce_mean(states.stack(), axis=0)]
    for _ in range(3):
        post.append(tf.tanh(tf.matmul(post[-1], w_out)))
    y = tf.reduce_sum(tf.square(post[-1]))
    return Model(ys=[y], xs=[x, w_in, w_rec, w_out],
                 lists={"around_loop": [pre[0], post[2]], "after_loop": [post[1]],
                        "loop_output": [last]})


def _rnn_model_without_loop_output_list(ctx, x):
    model = _rnn_model(ctx, x)
    del model.lists["loop_output"]  # see test_v1_while_loop_output_as_checkpoint
    return model


@pytest.mark.parametrize("runtime,flavour", [
    ("session", "v1"), ("session", "v2"), ("function", "v2")])
def test_while_loop_rnn(runtime, flavour):
    if flavour == "v1":
        with control_flow_v1():
            outcome = gradients_vs_stock(runtime, _rnn_model_without_loop_output_list,
                                         {"x": _normal((2, 4, 3))})
    else:
        outcome = gradients_vs_stock(runtime, _rnn_model, {"x": _normal((2, 4, 3))})
    ops = {op.type for op in outcome.graph.get_operations()}
    assert ("Enter" in ops) == (flavour == "v1")
    assert bool(ops & {"While", "StatelessWhile"}) == (flavour == "v2")
    assert_matches_stock(outcome)


def test_v1_while_loop_output_as_checkpoint():
    with control_flow_v1():
        outcome = gradients_vs_stock("session", _rnn_model, {"x": _normal((2, 4, 3))},
                                     modes=())
    assert_matches_stock(outcome)


def _rnn_stack(ctx, x, layers=3, in_body=None):
    """`layers` tanh RNNs, each a tf.while_loop over the time steps of its
    input that reads its weights inside the body and writes a TensorArray, as
    Keras' LSTM does; `in_body(h)` runs in every body too."""
    hs = x
    for layer in range(layers):
        w = ctx.variable(f"w{layer}", _normal((hs.shape[-1], 6), 0.5, seed=2 * layer))
        u = ctx.variable(f"u{layer}", _normal((6, 6), 0.4, seed=2 * layer + 1))

        def body(t, h, outs, inputs=hs, w=w, u=u):
            h = tf.tanh(tf.matmul(inputs[:, t], w) + tf.matmul(h, u))
            h = in_body(h) if in_body else h
            return t + 1, h, outs.write(t, h)

        steps = hs.shape[1]
        _, _, outs = tf.while_loop(  # XLA needs the bound for the TensorArray
            lambda t, h, outs: t < steps, body, maximum_iterations=steps, loop_vars=[
                tf.constant(0), tf.zeros([hs.shape[0], 6]), tf.TensorArray(tf.float32, steps)])
        hs = tf.transpose(outs.stack(), [1, 0, 2])
    y = tf.reduce_sum(tf.square(hs))
    return Model(ys=[y], xs=[x] + list(ctx.variables.values()))


def _copied_loops(outcome):
    return _copied_forward_loops(outcome.graph, outcome.forward_ops)


def _copied_forward_loops(graph, forward_ops):
    """Names of the loops among `forward_ops` that were copied: a copy is named
    '<scope>/recompute_<level>/<forward op name>'. (recompute_copies misses
    them: differentiating a loop changes its attributes.)"""
    copied = set()
    for op in graph.get_operations():
        match = re.search(r"/recompute_\d+/(.+)$", op.name)
        if op.type in ("While", "StatelessWhile") and match and match.group(1) in forward_ops:
            copied.add(match.group(1))
    return copied


def test_loops_that_only_read_variables_are_recomputed(runtime):
    """Rerunning such a loop late frees its per-iteration state (test_memory)."""
    outcome = gradients_vs_stock(runtime, _rnn_stack, {"x": _normal((2, 5, 3))})
    assert_matches_stock(outcome)
    assert len(_copied_loops(outcome)) == 3


@pytest.mark.parametrize("effect", ["dropout", "dropout_in_nested_function", "assign"])
def test_loops_with_side_effects_are_kept_not_recomputed(runtime, effect):
    """A rerun would draw new random numbers or assign twice."""
    def build(ctx, x):
        if effect == "dropout":
            return _rnn_stack(ctx, x, in_body=lambda h: tf.nn.dropout(h, rate=0.3))
        if effect == "dropout_in_nested_function":
            dropout = tf.function(lambda h: tf.nn.dropout(h, rate=0.3), autograph=False)
            return _rnn_stack(ctx, x, in_body=dropout)
        count = ctx.variable("count", 0.0)

        def count_steps(h):
            with tf.control_dependencies([count.assign_add(1.0)]):
                return tf.identity(h)
        model = _rnn_stack(ctx, x, in_body=count_steps)
        model.xs = [v for v in model.xs if v is not count]
        return model

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((2, 5, 3))})
    assert_matches_stock(outcome, forward_unchanged=False)
    assert not _copied_loops(outcome)
    if effect == "assign":  # one step per time step and layer, in the one run
        assert outcome.variables["count"] == 3 * 5


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_keras_recurrent_layers(dropout):
    """Keras draws RNN dropout masks before the loop: the loops are rerun, the
    masks are kept (a redrawn mask would change the gradients). Without
    dropout and with a static batch size, the first loop reads the input only
    through a TensorList, which carries per-example data too."""
    import keras
    keras.utils.set_random_seed(0)
    layers = [keras.layers.LSTM(6, return_sequences=True, dropout=dropout,
                                recurrent_dropout=dropout / 2),
              keras.layers.GRU(5, return_sequences=True, dropout=dropout),
              keras.layers.LSTM(4, return_sequences=True)]

    def build(ctx, x):
        h = x
        for layer in layers:
            h = layer(h, training=True)
        weights = [w.value for layer in layers for w in layer.trainable_weights]
        return Model(ys=[tf.reduce_sum(tf.square(h))], xs=weights)  # as in training

    outcome = gradients_vs_stock("function", build, {"x": _normal((3, 7, 4))})
    assert_matches_stock(outcome, forward_unchanged=False)
    assert len(_copied_loops(outcome)) == len(layers)


def _loop_with_nested(ctx, x, nested):
    """A tanh RNN whose body runs `nested` control flow that reads a variable."""
    w = ctx.variable("w", _normal((3, 3), 0.5, seed=1))
    u = ctx.variable("u", _normal((3, 3), 0.5, seed=2))
    matmul_w = tf.function(lambda h: tf.tanh(tf.matmul(h, w)), autograph=False)

    def inner(t, h):
        if nested == "while":
            return tf.while_loop(lambda s, g: s < 2, lambda s, g: (s + 1, matmul_w.python_function(g)),
                                 [tf.constant(0), h])[1]
        if nested == "cond":
            return tf.cond(t % 2 == 0, lambda: matmul_w.python_function(h), lambda: h * 0.5)
        return matmul_w(h)

    def body(t, h):
        return t + 1, tf.tanh(tf.matmul(inner(t, h), u))

    _, h = tf.while_loop(lambda t, h: t < 3, body, [tf.constant(0), tf.tanh(x * 2.0)])
    return [tf.reduce_sum(tf.square(tf.tanh(h * 2.0)))], [x, w, u]


@pytest.mark.parametrize("nested", ["while", "cond", "function_call"])
def test_loops_with_nested_functional_ops_are_kept(nested):
    """Rerunning such a loop differentiates its rebuilt body, which raised
    (cond: no handle data; ours then stock: duplicate inner function) or gave
    wrong gradients (inner while) when no stock gradient came first."""
    ctx = Context()
    x = tf.constant(_normal((2, 3)))

    def run(*kinds):
        def step(x):
            ys, xs = _loop_with_nested(ctx, x, nested)
            return [stock_gradients(ys, xs) if kind == "stock"
                    else msg.gradients(ys, xs, checkpoints=kind) for kind in kinds]
        step = tf.function(step, autograph=False)
        graph = step.get_concrete_function(x).graph
        assert "while" in {op.name for op in graph.get_operations()}  # the forward loop
        copies = _copied_forward_loops(graph, {"while"})
        return [[g.numpy() for g in grads] for grads in step(x)], copies

    (stock,), _ = run("stock")
    alone, copies_alone = run("memory", "speed")
    ours_then_stock, copies_first = run("memory", "speed", "stock")
    assert not copies_alone and not copies_first
    for grads in alone + ours_then_stock:
        for ours, expected in zip(grads, stock):
            np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


def _add_to_variable(w, how):
    """Adds 0.1 to `w`, through a handle other than `w.handle` unless 'assign'."""
    step = tf.fill(w.shape, 0.1)
    if how == "assign":
        return w.assign_add(step)
    if how == "py_function":  # takes no handle at all
        written = tf.py_function(
            lambda: (w.assign_add(np.full(w.shape, 0.1, np.float32)), 0.0)[1], [], tf.float32)
    elif how == "in_v1_cond":  # the handle reaches the write through a Switch
        with control_flow_v1():
            written = tf.compat.v1.cond(tf.reduce_sum(step) > 0,
                                        lambda: w.assign_add(step).op, tf.no_op)
    else:
        if how == "handle_from_function":
            handle = tf.function(lambda: w.handle, autograph=False)()
        elif how == "handle_from_cond":
            handle = tf.cond(tf.reduce_sum(step) > 0, lambda: tf.identity(w.handle),
                             lambda: tf.identity(w.handle))
        else:  # handle_through_loop
            handle = tf.while_loop(lambda t, h: t < 1, lambda t, h: (t + 1, h), [0, w.handle])[1]
        written = tf.raw_ops.AssignAddVariableOp(resource=handle, value=step)
    with tf.control_dependencies([written]):
        return w.read_value()


def _rnn_stack_with_assign(ctx, x, when, how="assign"):
    """`_rnn_stack` with 0.1 added to its first weight `when`: 'before' the
    loops with a control dependency, 'in_program_order' before them without
    one (a tf.function orders it), or 'after' them, before backprop (as in a
    GAN step)."""
    w0 = ctx.variable("w0", _normal((x.shape[-1], 6), 0.5, seed=0))
    update = _add_to_variable(w0, how) if when != "after" else None
    # On the loops themselves: a Session runs a lowered loop's variable reads
    # as soon as the handle enters it, not after its data inputs.
    with tf.control_dependencies([update] if when == "before" else []):
        model = _rnn_stack(ctx, x)
    if when == "after":
        with tf.control_dependencies(model.ys):  # in a Session, too, after the loops
            update = _add_to_variable(w0, how)
    model.fetch["updated"] = update
    return model


def _first_loop_copied(outcome):
    """True if the loop reading the first weight (the first loop built) was rerun."""
    first_loop = min((op for op in outcome.graph.get_operations()
                      if op.type in ("While", "StatelessWhile") and op.name in outcome.forward_ops),
                     key=lambda op: op._id)  # pylint: disable=protected-access
    return first_loop.name in _copied_loops(outcome)


@pytest.mark.parametrize("when", ["before", "in_program_order", "after"])
def test_loops_reading_a_variable_assigned_before_backprop(runtime, when):
    """A rerun would read the new value: a loop whose variable may be assigned
    between the forward pass and backprop is kept; one assigned before the
    loop ran is rerun."""
    if runtime == "session" and when == "in_program_order":
        pytest.skip("a Session runs unordered ops in any order")
    outcome = gradients_vs_stock(runtime, lambda ctx, x: _rnn_stack_with_assign(ctx, x, when),
                                 {"x": _normal((2, 5, 3))})
    assert_matches_stock(outcome)
    assert len(_copied_loops(outcome)) == (3 if when != "after" else 2)
    assert _first_loop_copied(outcome) == (when != "after")


@pytest.mark.parametrize("runtime,how", [
    (runtime, how) for runtime in ("session", "function")
    for how in ("handle_from_function", "handle_from_cond", "handle_through_loop")] + [
    ("session", "in_v1_cond"), ("function", "py_function")])
def test_loops_reading_a_variable_written_through_another_handle(runtime, how):
    """Any handle that may point to the loop's variable counts, and so does
    Python, which needs none."""
    outcome = gradients_vs_stock(
        runtime, lambda ctx, x: _rnn_stack_with_assign(ctx, x, "after", how),
        {"x": _normal((2, 5, 3))})
    assert_matches_stock(outcome)
    assert not _first_loop_copied(outcome)


@pytest.mark.parametrize("flavour", ["v1", "v2"])
@pytest.mark.parametrize("take_true", [True, False])
def test_cond(runtime, flavour, take_true):
    if runtime != "session" and flavour == "v1":
        pytest.skip("tf.function always builds v2 control flow")

    def build(ctx, x, pred):
        w = ctx.variable("w", _normal((4, 4), 0.5, seed=1))
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
            "x": _normal((3, 4)), "pred": np.array(take_true)})
    assert_matches_stock(outcome)


# --- dtypes ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(tf.float16, 2e-3), (tf.bfloat16, 1e-2)],
                         ids=["float16", "bfloat16"])
def test_mixed_precision(runtime, dtype, tol):
    def build(ctx, x):
        ws = _dense_layers(ctx, [8, 16, 16, 16, 8])
        h = tf.cast(x, dtype)
        hs = []
        for w in ws:
            h = tf.tanh(tf.matmul(h, tf.cast(w, dtype)))
            hs.append(h)
            h = tf.cast(tf.sigmoid(tf.cast(h, tf.float32)) * 2.0, dtype)
        y = tf.reduce_sum(tf.square(tf.cast(h, tf.float32)))
        return Model(ys=[y], xs=[x] + ws, lists={"half": hs[::2]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((4, 8))})
    assert_matches_stock(outcome, rtol=tol, atol=tol)


# --- tf.gradients arguments ---------------------------------------------------------

def test_several_ys_with_grad_ys(runtime):
    def build(ctx, x, seed_a, seed_c):
        ws = _dense_layers(ctx, [5, 5, 5, 5, 5])
        hs = [x]
        for w in ws:
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        ys = [hs[-1], hs[2], tf.reduce_sum(hs[3])]
        return Model(ys=ys, xs=[x] + ws, grad_ys=[seed_a, None, seed_c],
                     lists={"inner": [hs[1], hs[3]], "with_a_y": [hs[2], hs[3]]})

    outcome = gradients_vs_stock(runtime, build, {
        "x": _normal((3, 5)), "seed_a": _normal((3, 5), seed=7),
        "seed_c": np.float32(-2.0)})
    assert_matches_stock(outcome)


@pytest.mark.parametrize("unconnected", [None, "zero"])
def test_unconnected_xs(runtime, unconnected):
    def build(ctx, x, other):
        w = ctx.variable("w", _normal((4, 4), 0.5, seed=1))
        unused = ctx.variable("unused", _normal((4, 4), seed=2))
        hs = [x]
        for _ in range(5):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        side = tf.tanh(other)  # depends on an x, but no y depends on it
        kwargs = {} if unconnected is None else {"unconnected_gradients": unconnected}
        return Model(ys=[tf.reduce_sum(hs[-1])], xs=[x, unused, w, other, side],
                     kwargs=kwargs, lists={"mid": [hs[2]]})

    outcome = gradients_vs_stock(runtime, build, {
        "x": _normal((2, 4)), "other": _normal((3,), seed=3)})
    if unconnected is None:
        assert outcome.stock[1] is None and outcome.stock[3] is None
    else:
        assert outcome.stock[1].shape == (4, 4) and not outcome.stock[1].any()
    assert_matches_stock(outcome)


def _leaky_residual_stack(ctx, x, depth=8):
    """A variable w, the block outputs [x, h1, ..., h_depth], and a scalar loss."""
    w = ctx.variable("w", _normal((6, 6), 0.5, seed=1))
    hs = [x]
    for _ in range(depth):
        hs.append(tf.tanh(tf.matmul(hs[-1], w)) + 0.5 * hs[-1])
    return w, hs, tf.reduce_sum(tf.square(hs[-1]))


def test_stop_gradients_pass_through(runtime):
    def build(ctx, x):
        w, hs, y = _leaky_residual_stack(ctx, x)
        return Model(ys=[y], xs=[x, w], kwargs={"stop_gradients": [hs[3], hs[6]]},
                     lists={"around_stops": [hs[2], hs[4], hs[7]], "at_stop": [hs[3]]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((2, 6))})
    assert_matches_stock(outcome)


def test_intermediate_tensor_as_x(runtime):
    def build(ctx, x):
        w, hs, y = _leaky_residual_stack(ctx, x)
        # x and w twice: tf.gradients answers each entry; none counts twice.
        return Model(ys=[y], xs=[hs[4], x, w, hs[2], x, w, y],
                     lists={"around": [hs[3], hs[6]], "at_x": [hs[4]]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((2, 6))})
    assert_matches_stock(outcome)


def test_gradients_called_twice_on_one_graph(runtime):
    def build(ctx, x):
        w = ctx.variable("w", _normal((6, 6), 0.5, seed=1))
        hs = [x]
        for _ in range(8):
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        # The same explicit list twice, after 'memory' and 'speed' already ran.
        return Model(ys=[y], xs=[x, w], lists={"first": hs[2::3], "again": hs[2::3]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((2, 6))})
    assert len(outcome.ours) == 4
    assert_matches_stock(outcome)


def test_forward_ops_are_untouched_by_the_rewrite():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 6])
        w = tf.Variable(_normal((6, 6), 0.5))
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
        ws = _dense_layers(ctx, [6, 6, 6, 6, 6, 6])
        with tf.device("/cpu:0"):
            hs = [x]
            for w in ws:
                hs.append(tf.tanh(tf.matmul(hs[-1], w)) * 1.5)
            y = tf.reduce_sum(hs[-1])
        return Model(ys=[y], xs=[x] + ws, lists={"list": hs[2::2]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((2, 6))})
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
        w = ctx.variable("w", _normal((8, 8), 0.4, seed=1))
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

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((5, 8))},
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
        w = ctx.variable("w", _normal((6, 6), 0.5, seed=1))
        hs = [x]
        for i in range(6):
            h = tf.matmul(hs[-1], w)
            hs.append(clipped_tanh(h) if i % 2 else tf.sigmoid(h))
        y = tf.reduce_sum(tf.square(hs[-1]))
        return Model(ys=[y], xs=[x, w], lists={"even": hs[2::2], "odd": hs[1::2]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((3, 6))})
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
        w = ctx.variable("w", _normal((6, 6), 0.4, seed=1))
        hs = [tf.sigmoid(x)]
        for i in range(6):
            hs.append(block(hs[-1], w) + hs[-1] if i % 2 else tf.sigmoid(hs[-1]) * hs[-1])
        # The loss reads a call's output directly too.
        y = tf.reduce_sum(tf.square(hs[-1])) + 0.5 * tf.reduce_sum(hs[2].op.inputs[0])
        return Model(ys=[y], xs=[x, w], lists={
            "residuals": hs[2::2], "calls": [h.op.inputs[0] for h in hs[2::2]],
            "products": hs[1::2]},
            kwargs={"stop_gradients": [hs[4].op.inputs[0]]} if user_stop else {})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((2, 6))})
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
        ws = [ctx.variable(f"w{i}", _normal((6, 6), 0.3, seed=i)) for i in range(4)]
        hs = [x]
        for w in ws:
            hs.append(hs[-1] + tf.tanh(tf.matmul(hs[-1], w)) * hs[-1])
        y = tf.reduce_sum(tf.square(hs[-1]))
        return Model(ys=[y], xs=[x] + ws, kwargs=kwargs, lists={"stream": hs[1:3]})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((3, 6))})
    assert_matches_stock(outcome)


def test_gradient_of_our_gradient(runtime):
    """A gradient penalty: stock tf.gradients differentiates through our rewrite."""
    def build(ctx, x):
        ws = [ctx.variable(f"w{i}", _normal((5, 5), 0.4, seed=i)) for i in range(4)]
        hs = [x]
        for w in ws:
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        y = tf.reduce_sum(hs[-1])
        stock_dx = stock_gradients(y, x)[0]
        ours_dx = msg.gradients(y, x, checkpoints="memory")[0]
        return Model(ys=[y], xs=ws, fetch={
            "stock": tf.stack(stock_gradients(tf.reduce_sum(stock_dx ** 2), ws)),
            "ours": tf.stack(stock_gradients(tf.reduce_sum(ours_dx ** 2), ws))})

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((2, 5))})
    # The fetches are gradients, not forward values: rounding may differ per graph.
    assert_matches_stock(outcome, forward_unchanged=False)
    np.testing.assert_allclose(outcome.forward["ours"], outcome.forward["stock"],
                               rtol=1e-5, atol=1e-6)
