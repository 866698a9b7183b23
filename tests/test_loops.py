"""Loops: v1 and v2 while loops differentiated as stock does, and which v2
loops are rerun during backprop (pure bodies, variables only read and not
assigned before backprop) or kept.

Built per runtime with `harness.gradients_vs_stock`, like test_models.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from harness import Context
from harness import Model
from harness import assert_matches_stock
from harness import control_flow_v1
from harness import copied_forward_loops
from harness import gradients_vs_stock
from harness import stock_gradients
from models import normal
from models import rnn_stack


def _rnn_model(ctx, x, steps=4):
    """tanh RNN over x[:, t] in a tf.while_loop, with layers before and after it.

    Each step runs an inner while loop and writes its state to a TensorArray,
    as dynamic_rnn does.
    """
    w_in = ctx.variable("w_in", normal((3, 6), 0.5, seed=1))
    w_rec = ctx.variable("w_rec", normal((6, 6), 0.4, seed=2))
    w_out = ctx.variable("w_out", normal((6, 6), 0.4, seed=3))
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
                                         {"x": normal((2, 4, 3))})
    else:
        outcome = gradients_vs_stock(runtime, _rnn_model, {"x": normal((2, 4, 3))})
    ops = {op.type for op in outcome.graph.get_operations()}
    assert ("Enter" in ops) == (flavour == "v1")
    assert bool(ops & {"While", "StatelessWhile"}) == (flavour == "v2")
    assert_matches_stock(outcome)


def test_v1_while_loop_output_as_checkpoint():
    with control_flow_v1():
        outcome = gradients_vs_stock("session", _rnn_model, {"x": normal((2, 4, 3))},
                                     modes=())
    assert_matches_stock(outcome)


def _copied_loops(outcome):
    return copied_forward_loops(outcome.graph, outcome.forward_ops)


def test_loops_that_only_read_variables_are_recomputed(runtime):
    """Rerunning such a loop late frees its per-iteration state (test_memory).
    Not in a Session: an assign made after `gradients` could run before the
    rerun (test_adversarial.test_session_assign_made_after_the_gradients_call)."""
    outcome = gradients_vs_stock(runtime, rnn_stack, {"x": normal((2, 5, 3))})
    assert_matches_stock(outcome)
    assert len(_copied_loops(outcome)) == (0 if runtime == "session" else 3)


@pytest.mark.parametrize("effect", ["dropout", "dropout_in_nested_function", "assign"])
def test_loops_with_side_effects_are_kept_not_recomputed(runtime, effect):
    """A rerun would draw new random numbers or assign twice."""
    def build(ctx, x):
        if effect == "dropout":
            return rnn_stack(ctx, x, in_body=lambda h: tf.nn.dropout(h, rate=0.3))
        if effect == "dropout_in_nested_function":
            dropout = tf.function(lambda h: tf.nn.dropout(h, rate=0.3), autograph=False)
            return rnn_stack(ctx, x, in_body=dropout)
        count = ctx.variable("count", 0.0)

        def count_steps(h):
            with tf.control_dependencies([count.assign_add(1.0)]):
                return tf.identity(h)
        model = rnn_stack(ctx, x, in_body=count_steps)
        model.xs = [v for v in model.xs if v is not count]
        return model

    outcome = gradients_vs_stock(runtime, build, {"x": normal((2, 5, 3))})
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

    outcome = gradients_vs_stock("function", build, {"x": normal((3, 7, 4))})
    assert_matches_stock(outcome, forward_unchanged=False)
    assert len(_copied_loops(outcome)) == len(layers)


@tf.custom_gradient
def _sine(h):
    """A user's tf.custom_gradient: its gradient closes over `h`."""
    return tf.sin(h), lambda dy: dy * tf.cos(h)


@pytest.mark.parametrize("activation", [tf.nn.silu, _sine], ids=["silu", "user"])
def test_loops_with_custom_gradients_are_kept(runtime, activation):
    """A tf.custom_gradient's gradient is a closure over the tensors of the
    trace that made it: differentiating the rerun's rebuilt body ran it on
    tensors of another graph, and tf.gradients raised (tf.nn.silu: "beta
    must be from the same graph")."""
    outcome = gradients_vs_stock(runtime, lambda ctx, x: rnn_stack(ctx, x, in_body=activation),
                                 {"x": normal((2, 5, 3))})
    assert_matches_stock(outcome)
    assert not _copied_loops(outcome)


def _loop_with_nested(ctx, x, nested):
    """A tanh RNN whose body runs `nested` control flow that reads a variable."""
    w = ctx.variable("w", normal((3, 3), 0.5, seed=1))
    u = ctx.variable("u", normal((3, 3), 0.5, seed=2))
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
    x = tf.constant(normal((2, 3)))

    def run(*kinds):
        def step(x):
            ys, xs = _loop_with_nested(ctx, x, nested)
            return [stock_gradients(ys, xs) if kind == "stock"
                    else msg.gradients(ys, xs, checkpoints=kind) for kind in kinds]
        step = tf.function(step, autograph=False)
        graph = step.get_concrete_function(x).graph
        assert "while" in {op.name for op in graph.get_operations()}  # the forward loop
        copies = copied_forward_loops(graph, {"while"})
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
    """`rnn_stack` with 0.1 added to its first weight `when`: 'before' the
    loops with a control dependency, 'in_program_order' before them without
    one (a tf.function orders it), or 'after' them, before backprop (as in a
    GAN step)."""
    w0 = ctx.variable("w0", normal((x.shape[-1], 6), 0.5, seed=0))
    update = _add_to_variable(w0, how) if when != "after" else None
    # On the loops themselves: a Session runs a lowered loop's variable reads
    # as soon as the handle enters it, not after its data inputs.
    with tf.control_dependencies([update] if when == "before" else []):
        model = rnn_stack(ctx, x)
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
                                 {"x": normal((2, 5, 3))})
    assert_matches_stock(outcome)
    if runtime == "session":  # loops reading variables are kept there
        assert not _copied_loops(outcome)
        return
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
        {"x": normal((2, 5, 3))})
    assert_matches_stock(outcome)
    assert not _first_loop_copied(outcome)
