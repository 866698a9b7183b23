"""Checkpointing inside one while loop (tfgraph/loop_chunks.py).

A rerunnable loop with a known bound is rerun in chunks during backprop; its
gradients must equal tf.gradients' whatever the chunk size, and its peak
memory must drop (design.md section 4).
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from harness import Model
from harness import assert_matches_stock
from harness import gradients_vs_stock
from harness import stock_gradients
from memory_saving_gradients.tfgraph import loop_bounds
from memory_saving_gradients.tfgraph import loop_chunks
from memory_saving_gradients.tfgraph import loop_replay

# These tests are about the chunks of a loop a level reruns or that is
# differentiated after the last checkpoint (conftest.py).
pytestmark = pytest.mark.usefixtures("loops_rerun_by_their_levels")


def _normal(shape, scale=1.0, seed=0):
    return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


def _kept_in_a_session(runtime, chunked):
    """In a tf.compat.v1 Session loops reading variables are kept, never rerun
    (an assign made after the gradients call could run before a rerun)."""
    return 0 if runtime == "session" else chunked


def _chunk_loops(graph):
    """Loops that got our chunk gradient (all chunks but each loop's last)."""
    return [op for op in graph.get_operations()
            if op.type in ("While", "StatelessWhile")
            and op.node_def.attr["_gradient_op_type"].s == loop_chunks.CHUNK_GRADIENT.encode()]


@pytest.fixture
def chunk_size(monkeypatch):
    """Sets the chunk size the rewrite uses: `chunk_size(k)`."""
    return lambda k: monkeypatch.setattr(loop_chunks, "choose_chunk_size", lambda loop, bound: k)


def _lstm_like(ctx, x, bounded=True):
    """A hand-written RNN: two carried states, a TensorArray of outputs, weights
    read in the body; bounded by maximum_iterations (as Keras and tf.scan do),
    else only by its condition `t < steps` (as AutoGraph's loops are)."""
    steps = x.shape[1]
    w = ctx.variable("w", _normal((3, 5), 0.5, seed=1))
    u = ctx.variable("u", _normal((5, 5), 0.4, seed=2))

    def body(t, h, c, outs):
        c = 0.5 * c + tf.tanh(tf.matmul(x[:, t], w) + tf.matmul(h, u))
        h = tf.sigmoid(c) * tf.tanh(c)
        return t + 1, h, c, outs.write(t, h)

    zeros = tf.zeros([x.shape[0], 5])
    _, h, c, outs = tf.while_loop(
        lambda t, *_: t < steps, body,
        [tf.constant(0), zeros, zeros, tf.TensorArray(tf.float32, steps)],
        maximum_iterations=steps if bounded else None)
    y = tf.reduce_sum(tf.square(outs.stack())) + tf.reduce_sum(h * c)
    return Model(ys=[y], xs=[x, w, u])


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("steps,size,chunked", [
    (6, 2, 2),   # 3 chunks, the last differentiated by the stock gradient
    (7, 3, 2),   # 3 + 3 + 1: the size does not divide T
    (1, 1, 0),   # one iteration: nothing to split
])
def test_hand_written_rnn_matches_stock(runtime, chunk_size, steps, size, chunked, bounded):
    if runtime == "xla" and not bounded:
        pytest.skip("tf.gradients cannot differentiate a loop without maximum_iterations "
                    "under XLA (ours can: test_autograph_loops_are_chunked_under_xla)")
    chunk_size(size)
    outcome = gradients_vs_stock(runtime, lambda ctx, x: _lstm_like(ctx, x, bounded),
                                 {"x": _normal((2, steps, 3))}, modes=("memory",))
    assert_matches_stock(outcome)
    assert len(_chunk_loops(outcome.graph)) == _kept_in_a_session(runtime, chunked)


# The loop's bound: 9 iterations, given as maximum_iterations or counted from
# its condition (a counter from `start` by `step` below `limit`); chunk loops
# made. A condition that also tests the data makes its count a cap the loop
# may stop far below: such a loop is rerun whole.
_NINE_ITERATIONS = {"maximum_iterations": (0, 1, None, 9, 4),
                    "condition t < 9": (0, 1, 9, None, 0),
                    "condition t < 21, from 3 by 2": (3, 2, 21, None, 0)}


@pytest.mark.parametrize("bound", sorted(_NINE_ITERATIONS))
def test_loop_stopped_early_by_its_condition(chunk_size, bound):
    """The condition ends the loop before its bound: the chunks run exactly the
    iterations the original ran (the later ones none)."""
    chunk_size(2)
    start, step, limit, maximum, chunked = _NINE_ITERATIONS[bound]

    def cond(t, h):
        early = tf.reduce_sum(h) < 40.0
        return early if limit is None else tf.logical_and(t < limit, early)

    def build(ctx, x):
        w = ctx.variable("w", _normal((4, 4), 0.5, seed=3))
        _, h = tf.while_loop(cond, lambda t, h: (t + step, h + tf.exp(tf.matmul(h, w) * 0.1)),
                             [tf.constant(start), x], maximum_iterations=maximum)
        return Model(ys=[tf.reduce_sum(tf.sin(h))], xs=[x, w])

    outcome = gradients_vs_stock("function", build, {"x": _normal((2, 4), 0.1)},
                                 modes=("memory",))
    assert_matches_stock(outcome)
    assert len(_chunk_loops(outcome.graph)) == chunked


def test_loop_without_a_known_trip_count_is_rerun_whole_and_says_why(chunk_size, caplog):
    """No maximum_iterations, and a condition on the data only."""
    chunk_size(2)

    def build(ctx, x):
        w = ctx.variable("w", _normal((4, 4), 0.5, seed=3))
        _, h = tf.while_loop(lambda t, h: tf.reduce_sum(h) < 40.0,
                             lambda t, h: (t + 1, h + tf.exp(tf.matmul(h, w) * 0.1)),
                             [tf.constant(0), x])
        return Model(ys=[tf.reduce_sum(tf.sin(h))], xs=[x, w])

    with caplog.at_level(logging.INFO, logger="memory_saving_gradients"):
        outcome = gradients_vs_stock("function", build, {"x": _normal((2, 4), 0.1)},
                                     modes=("memory",))
    assert_matches_stock(outcome)
    assert not _chunk_loops(outcome.graph)
    assert "trip count is not known" in caplog.text


@pytest.fixture
def runtime_chunks(monkeypatch):
    """Sets the chunk count of loops bounded at run time: `runtime_chunks(c)`."""
    return lambda count: monkeypatch.setattr(loop_chunks, "RUNTIME_CHUNKS", count)


def _ours_vs_stock_over(make_step, argument_sets, rtol=1e-5):
    """`make_step(differentiate)` -> a step; ours ("memory") and stock's steps
    give equal results on each tuple of `argument_sets`. Returns ours."""
    ours = make_step(lambda y, xs: msg.gradients(y, xs, checkpoints="memory"))
    stock = make_step(stock_gradients)
    for args in argument_sets:
        for mine, theirs in zip(tf.nest.flatten(ours(*args)), tf.nest.flatten(stock(*args))):
            np.testing.assert_allclose(mine, theirs, rtol=rtol, atol=rtol / 10)
    return ours


@pytest.mark.parametrize("given", ["at run time", "-1", "set_loop_options"])
def test_a_maximum_iterations_known_at_run_time_is_chunked(runtime_chunks, given):
    """`t < 10` counts 10 iterations, but a maximum_iterations given at run
    time (or -1: none) stops the loop first. Chunks given `10 // 3` in its
    place ran on to 10 (a review in session 40: gradients up to 3.7x off).
    Now the loop is laid out in 3 chunks of ceil(n / 3) iterations, n read
    when the step runs; n from 0 to past 10, each with its own chunk sizes."""
    runtime_chunks(3)
    w = tf.Variable(_normal((4, 4), 0.5, seed=1))
    x = tf.constant(_normal((2, 4), 1.0))
    body = lambda t, h: (t + 1, tf.tanh(h @ w) + 0.5 * h)  # noqa: E731

    def loss(x, n):
        if given == "set_loop_options":
            h = x
            for _ in tf.range(10):
                tf.autograph.experimental.set_loop_options(maximum_iterations=n)
                h = body(0, h)[1]
        else:
            _, h = tf.while_loop(lambda t, h: t < 10, body, [tf.constant(0), x],
                                 maximum_iterations=-1 if given == "-1" else n)
        return tf.reduce_sum(tf.square(tf.sin(h)))

    def step(differentiate):
        @tf.function
        def run(x, n):
            value = loss(x, n)
            return value, differentiate(value, [x, w])
        return run

    # n a tensor: known when the step runs, not when it is traced
    counts = [(x, tf.constant(count)) for count in [0, 1, 2, 3, 4, 7, 9, 12]]
    ours = _ours_vs_stock_over(step, counts)
    recorded, reruns = _loop_runs(ours.get_concrete_function(*counts[0]).graph)
    # States saved forward, 3 chunks replayed; -1, known now, runs no
    # iteration: nothing to chunk.
    if given == "-1":
        assert recorded == 0 and len(reruns) <= 1
    else:
        assert (recorded, len(reruns)) == (1, 3)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_keras_rnn_over_sequences_of_unknown_length(runtime_chunks, kind):
    """A step traced with a None time dimension: the Keras loop's
    maximum_iterations is the sequence length, read when the step runs. One
    trace serves 1, 5 and 11 steps, each laid out in 4 chunks."""
    runtime_chunks(4)
    tf.keras.utils.set_random_seed(0)
    layer = getattr(tf.keras.layers, kind)(6, return_sequences=True)
    layer.build((None, None, 3))
    signature = [tf.TensorSpec([None, None, 3], tf.float32)]

    def step(differentiate):
        @tf.function(input_signature=signature)
        def run(x):
            hs = layer(x)
            return differentiate(tf.reduce_sum(tf.square(hs)) + tf.reduce_sum(hs[:, -1]),
                                 [x] + layer.trainable_weights)
        return run

    ours = _ours_vs_stock_over(
        step, [(tf.constant(_normal((2, steps, 3), seed=steps)),) for steps in [1, 5, 11]])
    # Its level reruns it; it writes a TensorArray of run-time length, so as a
    # chain of 4 chunks (`_forward_outputs_too_big`), all but the last ours.
    assert len(_chunk_loops(ours.get_concrete_function(*signature).graph)) == 3


def _counted_at_run_time(form, x, n, w):
    """AutoGraph's loops (no maximum_iterations) whose count is known only
    when the step runs: over `tf.range(n)`, over the time axis of `x` (of
    unknown length), `while t < n`, and a uint8 counter stepped by 100 below
    n = 250 that wraps around and runs on (its count cannot be trusted)."""
    h = x[:, 0]
    if form == "range":
        for t in tf.range(n):
            h = tf.tanh(h @ w) + x[:, t]
    elif form == "over a tensor":
        for x_t in tf.transpose(x, [1, 0, 2]):
            h = tf.tanh(h @ w) + x_t
    elif form == "while":
        t = 0
        while t < n:
            h = tf.tanh(h @ w) + x[:, t]
            t += 1
    else:
        t, limit = tf.constant(0, tf.uint8), tf.cast(n, tf.uint8)
        while t < limit:
            h = tf.tanh(h @ w) + x[:, tf.cast(t, tf.int32) % 9]
            t += tf.constant(100, tf.uint8)
    return tf.reduce_sum(tf.square(h))


@pytest.mark.parametrize("form", ["range", "over a tensor", "while", "wrapping counter"])
def test_a_count_its_condition_makes_at_run_time_is_chunked(runtime_chunks, form):
    """One trace serves every n: 3 chunks of ceil(n / 3) iterations, sized
    when the step runs. The wrapping counter's chunks are given every
    iteration (its first chunk runs all 23)."""
    runtime_chunks(3)
    w = tf.Variable(_normal((4, 4), 0.5, seed=1))
    signature = [tf.TensorSpec([2, None, 4], tf.float32), tf.TensorSpec([], tf.int32)]

    def step(differentiate):
        return tf.function(lambda x, n: differentiate(_counted_at_run_time(form, x, n, w),
                                                      [x, w]), input_signature=signature)

    counts = [250] if form == "wrapping counter" else [0, 1, 2, 4, 9]
    ours = _ours_vs_stock_over(step, [
        (tf.constant(_normal((2, 9 if form != "over a tensor" else max(count, 1), 4), 0.5,
                             seed=count)), tf.constant(count)) for count in counts])
    recorded, reruns = _loop_runs(ours.get_concrete_function(*signature).graph)
    assert (recorded, len(reruns)) == (1, 3)


@pytest.mark.parametrize("bound", ["at run time", "known now"])
def test_a_state_whose_shape_changes_is_replayed_as_it_was(runtime_chunks, chunk_size, bound):
    """A carried state growing by a row per step (shape_invariants): a chunk
    past the loop's end read its saved state through a select with the final
    state, of another shape; it failed, or where a size was 1 broadcast
    (a review; known-now bounds too, since session 39)."""
    runtime_chunks(3)
    chunk_size(3)
    w = tf.Variable(_normal((4, 4), 0.5, seed=1))
    x = tf.constant(_normal((2, 4), 1.0))

    def step(differentiate):
        @tf.function
        def run(x, n):
            def body(t, h, rows):
                h = tf.tanh(h @ w) + 0.5 * h
                return t + 1, h, tf.concat([rows, h], 0)
            _, h, rows = tf.while_loop(
                lambda t, h, rows: t < 6, body, [tf.constant(0), x, x],
                maximum_iterations=n if bound == "at run time" else 11,
                shape_invariants=[tf.TensorShape([]), tf.TensorShape([2, 4]),
                                  tf.TensorShape([None, 4])])
            loss = tf.reduce_sum(tf.sin(rows) ** 2) + tf.reduce_sum(h)
            return differentiate(loss, [x, w])
        return run

    _ours_vs_stock_over(step, [(x, tf.constant(count)) for count in [0, 1, 2, 5, 11]])


def test_a_64_bit_counter_near_its_limits_is_rerun_whole(runtime_chunks):
    """Counted in int64 at run time, `limit - start` or the wrap test
    overflowed: 4 and 6 iterations were counted 0 and 1 (a review: gradients
    3.9 off, or a crash). A 64-bit counter is not counted at run time."""
    runtime_chunks(3)
    most = 2 ** 63
    w = tf.Variable(_normal((2, 2), 0.3, seed=1).astype(np.float64))
    x = tf.constant(_normal((1, 2), 1.0).astype(np.float64))
    signature = [tf.TensorSpec([], tf.int64)] * 2

    def step(differentiate, stride):
        @tf.function(input_signature=signature)
        def run(start, limit):
            h, t = x, start
            while t < limit:
                h = tf.tanh(h @ w) + x
                t += tf.constant(stride, tf.int64)
            return differentiate(tf.reduce_sum(h ** 2), [x, w])
        return run

    for start, limit, stride in [(-int(0.9 * most), int(0.9 * most), int(0.45 * most)),
                                 (int(0.5 * most) - 1, int(0.6 * most), int(0.7 * most))]:
        args = (tf.constant(start, tf.int64), tf.constant(limit, tf.int64))
        ours = _ours_vs_stock_over(lambda differentiate: step(differentiate, stride), [args],
                                   rtol=1e-10)
        assert _loop_runs(ours.get_concrete_function(*signature).graph)[0] == 0


def test_a_bound_known_at_run_time_under_xla_is_rerun_whole(runtime_chunks):
    """XLA compiles such a bound as a constant, and the chunks past it (given
    no iteration) failed to compile: the loop is rerun whole there."""
    runtime_chunks(3)
    w = tf.Variable(_normal((4, 4), 0.5, seed=1))
    x = tf.constant(_normal((2, 4), 1.0))

    def step(differentiate):
        def run(x, n):
            _, h = tf.while_loop(lambda t, h: t < 10,
                                 lambda t, h: (t + 1, tf.tanh(h @ w) + 0.5 * h),
                                 [tf.constant(0), x], maximum_iterations=n)
            return differentiate(tf.reduce_sum(tf.square(tf.sin(h))), [x, w])
        return tf.function(run, jit_compile=True)

    n = tf.constant(7)
    ours = _ours_vs_stock_over(step, [(x, n)])
    assert _loop_runs(ours.get_concrete_function(x, n).graph)[0] == 0


def test_a_chain_of_chunks_with_a_bound_known_at_run_time(runtime_chunks):
    """Where the forward loop cannot save its states (tf.gradients already
    differentiated it), the chain of chunks is laid out at run time too."""
    runtime_chunks(4)
    w = tf.Variable(_normal((4, 4), 0.5, seed=1))
    x = tf.constant(_normal((2, 4), 1.0))

    @tf.function
    def both(x, n):
        _, h = tf.while_loop(lambda t, h: True, lambda t, h: (t + 1, tf.tanh(h @ w) + 0.5 * h),
                             [tf.constant(0), x], maximum_iterations=n)
        loss = tf.reduce_sum(tf.square(tf.sin(h)))
        return stock_gradients(loss, [x, w]), msg.gradients(loss, [x, w], checkpoints="memory")

    for count in [0, 1, 3, 5, 11]:
        stock, ours = both(x, tf.constant(count))
        for mine, theirs in zip(ours, stock):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    assert len(_chunk_loops(both.get_concrete_function(x, tf.constant(3)).graph)) == 3


def _autograph_loops(x, w, dynamic_list=True):
    """Loops as AutoGraph writes them from Python (in a tf.function with
    autograph on): none has maximum_iterations; each condition counts."""
    h = x[:, 0]
    for t in tf.range(x.shape[1]):
        h = tf.tanh(tf.matmul(h, w) + x[:, t])
    for xt in tf.transpose(x, [1, 0, 2]):  # iterating over a tensor
        h = tf.sin(tf.matmul(h, w)) + xt
    for _ in tf.range(2, 20, 3):  # 6 iterations
        h = tf.tanh(tf.matmul(h, w))
    t = tf.constant(0)
    while t < 7:
        h = tf.tanh(tf.matmul(h, w)) * 1.5
        t += 1
    loss = tf.reduce_sum(tf.square(h))
    if dynamic_list:  # a dynamic-size TensorArray: resized, so rerun as a chain
        written = tf.TensorArray(tf.float32, size=0, dynamic_size=True)
        for t in tf.range(5):
            h = tf.tanh(tf.matmul(h, w))
            written = written.write(t, h)
        loss += tf.reduce_sum(tf.square(written.stack()))
    return loss


def test_autograph_loops_are_chunked(chunk_size):
    """AutoGraph's `for t in tf.range(n)`, `for x_t in tensor` and `while t < n`
    loops carry no maximum_iterations; their conditions bound them, so they
    are chunked too, and the forward loops compute what they did."""
    chunk_size(2)
    w = tf.Variable(_normal((4, 4), 0.6, seed=6))
    x = tf.constant(_normal((3, 6, 4), 0.5))

    def build(x):
        loss = _autograph_loops(x, w)
        loops_ = [op for op in loss.graph.get_operations()
                  if op.type in ("While", "StatelessWhile")]
        assert [loop_bounds.trip_bound(op) for op in loops_] == [None] * 5
        assert [loop_bounds.trip_count(op) for op in loops_] == [6, 6, 6, 7, 5]
        return loss, [x, w], loops_

    def ours(loss, xs, loops_):
        with loop_chunks.chunked_gradients(loops_):
            return stock_gradients(loss, xs)

    graph = _ours_alone_vs_stock(build, [x], gradients=ours, autograph=True)
    recorded, reruns = _rerun_iterations(graph)
    assert recorded == 4  # the dynamic TensorArray's loop is rerun as a chain
    assert reruns == 6 + 6 + 6 + 7 + (5 + 4)


@pytest.mark.slow
def test_autograph_loops_are_chunked_under_xla(chunk_size):
    """Under XLA, tf.gradients cannot differentiate a loop without
    maximum_iterations (its stacks need a fixed size); its chunks have one."""
    chunk_size(2)
    w = tf.Variable(_normal((4, 4), 0.6, seed=6))
    x = tf.constant(_normal((3, 6, 4), 0.5))

    def step(gradients, jit):
        def run(x):
            loss = _autograph_loops(x, w, dynamic_list=False)
            loops_ = [op for op in loss.graph.get_operations()
                      if op.type in ("While", "StatelessWhile")]
            with loop_chunks.chunked_gradients(loops_ if gradients == "ours" else []):
                return loss, stock_gradients(loss, [x, w])
        return tf.function(run, jit_compile=jit)

    with pytest.raises(tf.errors.InvalidArgumentError, match="maximum_iteration"):
        step("stock", jit=True)(x)
    (ours_loss, ours_grads), (stock_loss, stock_grads) = step("ours", True)(x), step(
        "stock", False)(x)
    np.testing.assert_allclose(ours_loss, stock_loss, rtol=1e-5)
    for mine, theirs in zip(ours_grads, stock_grads):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)


def test_scan(runtime, chunk_size):
    chunk_size(3)

    def build(ctx, x):
        w = ctx.variable("w", _normal((4, 4), 0.5, seed=4))
        hs = tf.scan(lambda h, xt: tf.tanh(tf.matmul(h, w) + xt), x,
                     initializer=tf.zeros([2, 4]))
        return Model(ys=[tf.reduce_sum(tf.square(hs))], xs=[x, w])

    outcome = gradients_vs_stock(runtime, build, {"x": _normal((8, 2, 4))},
                                 modes=("memory",))
    assert_matches_stock(outcome)
    assert len(_chunk_loops(outcome.graph)) == _kept_in_a_session(runtime, 2)


def test_keras_recurrent_layers(chunk_size):
    import keras
    chunk_size(3)
    keras.utils.set_random_seed(0)
    layers = [keras.layers.LSTM(6, return_sequences=True),
              keras.layers.GRU(5, return_sequences=True),
              keras.layers.SimpleRNN(4)]

    def build(ctx, x):
        h = x
        for layer in layers:
            h = layer(h)
        weights = [w.value for layer in layers for w in layer.trainable_weights]
        return Model(ys=[tf.reduce_sum(tf.square(h))], xs=[x] + weights)

    outcome = gradients_vs_stock("function", build, {"x": _normal((2, 7, 3))},
                                 modes=("memory",))
    assert_matches_stock(outcome)
    assert len(_chunk_loops(outcome.graph)) == 2 * len(layers)  # 3 + 3 + 1 steps each


@pytest.mark.parametrize("bounded", [True, False, "at run time", "at run time, far above"])
def test_long_loop_keeps_a_fraction_of_stock_memory(bounded):
    """T = 400 steps of a [16, 256] state: tf.gradients keeps every step's
    intermediates; chunks of 20 keep 20 states and one chunk's intermediates.
    The same where only the loop's condition bounds it, and where its
    maximum_iterations is a tensor (16 chunks of 25), also one far above
    what the condition allows (a review: laid out over n = 100,000, all 400
    iterations fell in one chunk)."""
    steps, batch, units = 400, 16, 256
    w = tf.Variable(_normal((units, units), 1.0 / np.sqrt(units), seed=5))
    x = tf.constant(_normal((batch, units), 0.5))
    n = tf.constant(100_000 if bounded == "at run time, far above" else steps)

    def loss(x, n):
        _, h = tf.while_loop(
            lambda t, h: t < steps,
            lambda t, h: (t + 1, tf.tanh(tf.matmul(h, w)) * tf.sigmoid(h) + 0.5 * h),
            [tf.constant(0), x], maximum_iterations={True: steps, False: None}.get(bounded, n))
        return tf.reduce_sum(tf.square(h))

    @tf.function
    def stock(x, n):
        return stock_gradients(loss(x, n), [w])

    @tf.function
    def ours(x, n):
        return msg.gradients(loss(x, n), [w], checkpoints="memory")

    np.testing.assert_allclose(ours(x, n)[0], stock(x, n)[0], rtol=1e-4, atol=1e-6)
    graph = ours.get_concrete_function(x, n).graph
    if isinstance(bounded, str):
        recorded, reruns = _loop_runs(graph)
        assert (recorded, len(reruns)) == (1, loop_chunks.RUNTIME_CHUNKS)
    else:
        assert _rerun_iterations(graph) == (1, steps)  # states saved forward
    gradient_bytes = units * units * 4  # the output, not activation memory
    stock_peak, _ = msg.function_peak_bytes(stock, x, n)
    ours_peak, _ = msg.function_peak_bytes(ours, x, n)
    ratio = (ours_peak - gradient_bytes) / (stock_peak - gradient_bytes)
    assert ratio <= 0.3, (ours_peak, stock_peak)


def test_checkpoint_plan_shows_each_loops_chunk_size():
    w = tf.Variable(_normal((4, 4), 0.5))
    plans = []

    @tf.function(autograph=False)
    def step(x):  # in a tf.function: loops reading variables may be rerun
        bounded = tf.while_loop(lambda t, h: t < 100, lambda t, h: (t + 1, tf.tanh(h @ w)),
                                [0, x], maximum_iterations=100, name="bounded")[1]
        counted = tf.while_loop(lambda t, h: t < 100, lambda t, h: (t + 1, tf.tanh(h @ w)),
                                [0, bounded], name="counted")[1]
        unbounded = tf.while_loop(lambda t, h: tf.reduce_sum(h) < 1e6,
                                  lambda t, h: (t + 1, tf.tanh(h @ w) + h),
                                  [0, counted], name="unbounded")[1]
        plans.append(msg.checkpoint_plan(tf.reduce_sum(unbounded), [w]))
        return unbounded

    step.get_concrete_function(tf.TensorSpec([2, 4]))
    plan = plans[0]
    notes = "\n".join(plan.notes)
    assert "loop bounded: rerun in chunks of 10 of its at most 100 iterations\n" in notes
    assert ("loop counted: rerun in chunks of 10 of its at most 100 iterations (counted from "
            "its condition)") in notes
    assert "loop unbounded: rerun whole: its trip count is not known" in notes


def test_chunk_size_balances_saved_states_and_one_chunk():
    from memory_saving_gradients.core.loop_chunking import chunk_size, chunked_bytes
    assert chunk_size(1) == 1
    assert chunk_size(100) == 10
    assert chunk_size(100, state_bytes=1, step_bytes=4) == 5  # big steps: short chunks
    for trip, state, step in [(1000, 1, 1), (37, 3, 5), (4000, 10, 1)]:
        best = min(chunked_bytes(trip, k, state, step) for k in range(1, trip + 1))
        assert chunked_bytes(trip, chunk_size(trip, state, step), state, step) == best


# --- Chunk states saved by the forward pass (loop_recording, loop_replay) ---
# The harness builds stock tf.gradients first in the same graph, which makes
# the forward loop carry while_v2's accumulators: then it is rerun as a chain
# (tested above). Below, ours is built alone in its tf.function.

def _ours_alone_vs_stock(build, args, in_place=False, jit=False, gradients=None,
                         autograph=False, stock_jit=None):
    """`build(*args) -> (loss, xs, a loop output)` differentiated by ours
    (checkpoints='memory', or with `in_place` by tf.gradients within
    `chunked_gradients` as the rewrite does for a loop it does not copy; or
    `gradients(loss, xs, what build returned third)`) and by stock, in two
    tf.functions (stock's compiled as `stock_jit`, by default as ours);
    asserts equal losses (the recorded forward computes what it did) and
    gradients. Returns ours' graph."""
    def ours_gradients(loss, xs, loop_output):
        if not in_place:
            return msg.gradients(loss, xs, checkpoints="memory")
        with loop_chunks.chunked_gradients([loop_output.op]):
            return stock_gradients(loss, xs)

    def step(gradients, compiled):
        def run(*inputs):
            loss, xs, loop_output = build(*inputs)
            return loss, gradients(loss, xs, loop_output)
        return tf.function(run, autograph=autograph, jit_compile=compiled)

    ours = step(gradients or ours_gradients, jit)
    stock = step(lambda loss, xs, loop_output: stock_gradients(loss, xs),
                 jit if stock_jit is None else stock_jit)
    (ours_loss, ours_grads), (stock_loss, stock_grads) = ours(*args), stock(*args)
    np.testing.assert_allclose(ours_loss, stock_loss, rtol=1e-6)
    for mine, theirs in zip(ours_grads, stock_grads):
        np.testing.assert_allclose(tf.convert_to_tensor(mine), tf.convert_to_tensor(theirs),
                                   rtol=1e-5, atol=1e-6)
    return ours.get_concrete_function(*args).graph


def _loop_runs(graph):
    """(forward loops that record their chunk states, the loops rerun during
    backprop)."""
    loops_ = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    recorded = [op for op in loops_ if "_recorded_" in op.get_attr("body").name]
    return len(recorded), [op for op in loops_ if op.name.startswith("gradients")
                           and "_grad_" not in op.get_attr("body").name]


def _rerun_iterations(graph):
    """(forward loops that record their chunk states, iterations the reruns
    of loops may run: the sum of their bounds). A chain of chunks rerun from
    the inputs would add T iterations more."""
    recorded, reruns = _loop_runs(graph)
    return recorded, sum(int(tf.get_static_value(op.inputs[1])) for op in reruns)


class _Rnn:
    """A hand-written RNN: carried int t, h, c, a TensorArray of `written`
    elements; weights read in the body (variables made once); bounded by
    maximum_iterations, or by its condition alone."""

    def __init__(self, written, bounded=True):
        self.written = written
        self.bounded = bounded
        self.w = tf.Variable(_normal((3, 5), 0.5, seed=1))
        self.u = tf.Variable(_normal((5, 5), 0.4, seed=2))

    def __call__(self, x):
        steps, written = x.shape[1], self.written

        def body(t, h, c, outs):
            c = 0.5 * c + tf.tanh(tf.matmul(x[:, t], self.w) + tf.matmul(h, self.u))
            h = tf.sigmoid(c) * tf.tanh(c)
            return t + 1, h, c, outs.write(tf.minimum(t, written - 1), h)

        zeros = tf.zeros([x.shape[0], 5])
        loop = tf.while_loop(lambda t, *_: t < steps, body,
                             [tf.constant(0), zeros, zeros, tf.TensorArray(tf.float32, written)],
                             maximum_iterations=steps if self.bounded else None)
        t, h, c, outs = loop
        loss = tf.reduce_sum(tf.square(outs.stack())) + tf.reduce_sum(h * c)
        return loss, [x, self.w, self.u], h


@pytest.mark.parametrize("steps,size,jit,bounded", [
    (7, 3, False, True), (6, 2, False, True), (7, 3, False, False),
    pytest.param(7, 3, True, True, marks=pytest.mark.slow),
    pytest.param(7, 3, True, False, marks=pytest.mark.slow)])
def test_in_place_loop_reruns_each_chunk_once(chunk_size, steps, size, jit, bounded):
    """Differentiated in place: the forward loop saves its chunk states and
    the reruns run T iterations in all, not 2T as from a chain of chunks."""
    chunk_size(size)
    # Under XLA tf.gradients cannot differentiate a loop without maximum_iterations.
    graph = _ours_alone_vs_stock(_Rnn(steps, bounded), [tf.constant(_normal((2, steps, 3)))],
                                 in_place=True, jit=jit, stock_jit=jit and bounded)
    assert _rerun_iterations(graph) == (1, steps)


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_copied_loop_uses_the_forward_states(chunk_size, jit, bounded):
    """Recomputed by the plan: its outputs (a final state, a one-element
    TensorArray as Keras' return_sequences=False writes) come from the
    forward pass and its gradient reruns each chunk once. Under XLA its
    TensorLists keep it a chain (same gradients)."""
    chunk_size(3)
    graph = _ours_alone_vs_stock(_Rnn(1, bounded), [tf.constant(_normal((2, 7, 3)))], jit=jit,
                                 stock_jit=jit and bounded)
    assert _rerun_iterations(graph) == ((1, 7) if not jit else (0, 7 + 6))


def test_copied_loop_writing_a_long_sequence_stays_a_chain(chunk_size, caplog):
    """Its T-element TensorArray would have to be kept from the forward pass."""
    chunk_size(3)
    with caplog.at_level(logging.INFO, logger="memory_saving_gradients"):
        graph = _ours_alone_vs_stock(_Rnn(7), [tf.constant(_normal((2, 7, 3)))])
    assert _rerun_iterations(graph) == (0, 7 + 6)
    assert "it writes a TensorArray of 7 elements" in caplog.text


def test_forward_saved_states_with_one_iteration_and_early_stop(chunk_size):
    chunk_size(2)
    w = tf.Variable(_normal((4, 4), 0.5, seed=3))

    def build(x, steps):
        _, h = tf.while_loop(lambda t, h: tf.reduce_sum(h) < 40.0,
                             lambda t, h: (t + 1, h + tf.exp(tf.matmul(h, w) * 0.1)),
                             [tf.constant(0), x], maximum_iterations=steps)
        return tf.reduce_sum(tf.sin(h)), [x, w], h

    x = tf.constant(_normal((2, 4), 0.1))
    graph = _ours_alone_vs_stock(lambda x: build(x, 9), [x], in_place=True)
    assert _rerun_iterations(graph) == (1, 9)  # stops after 5 iterations, in chunk 2 of 5
    graph = _ours_alone_vs_stock(lambda x: build(x, 1), [x], in_place=True)
    assert _rerun_iterations(graph)[0] == 0  # one iteration: no chunks


@pytest.mark.slow
def test_forward_saved_states_of_scan_and_keras_layers(chunk_size):
    import keras
    chunk_size(3)
    keras.utils.set_random_seed(0)
    layers = [keras.layers.LSTM(6, return_sequences=True), keras.layers.GRU(5),
              keras.layers.SimpleRNN(4)]
    x = tf.constant(_normal((2, 7, 3)))
    for layer in layers:
        layer.build(x.shape if layer is layers[0] else (2, 7, 6))
    w = tf.Variable(_normal((4, 4), 0.5, seed=4))

    def build(x):
        h = layers[0](x)
        hs = tf.scan(lambda s, xt: tf.tanh(tf.matmul(s, w) + xt[:, :4]),
                     tf.transpose(h, [1, 0, 2]), initializer=tf.zeros([2, 4]))
        loss = tf.reduce_sum(tf.square(layers[1](h))) + tf.reduce_sum(layers[2](h))
        weights = [v.value for layer in layers for v in layer.trainable_weights]
        return loss + tf.reduce_sum(tf.square(hs)), [x, w] + weights, None

    graph = _ours_alone_vs_stock(build, [x])
    assert _rerun_iterations(graph)[0] >= 1


def test_loop_in_a_nested_function_call(chunk_size):
    chunk_size(2)
    w = tf.Variable(_normal((4, 4), 0.5, seed=6))

    @tf.function(autograph=False)
    def inner(x):
        return tf.while_loop(lambda t, h: t < 6, lambda t, h: (t + 1, tf.tanh(h @ w)),
                             [0, x], maximum_iterations=6)[1]

    _ours_alone_vs_stock(lambda x: (tf.reduce_sum(tf.square(inner(x))), [x, w], None),
                         [tf.constant(_normal((2, 4)))])


def test_forward_saved_states_in_a_session(chunk_size):
    """A tf.compat.v1 graph run by a Session (a loop reading no variable)."""
    chunk_size(3)
    rng = np.random.RandomState(0)
    feeds = [rng.randn(2, 7, 4).astype(np.float32), _normal((4, 4), 0.5, seed=7)]
    results, recorded = [], []
    for gradients in (lambda loss, xs: msg.gradients(loss, xs, checkpoints="memory"),
                      stock_gradients):
        with tf.Graph().as_default() as graph:
            x, w = [tf.compat.v1.placeholder(tf.float32, f.shape) for f in feeds]
            _, h, outs = tf.while_loop(
                lambda t, *_: t < 7,
                lambda t, h, outs: (t + 1, tf.tanh(h @ w + x[:, t]), outs.write(0, h)),
                [0, tf.zeros([2, 4]), tf.TensorArray(tf.float32, 1)], maximum_iterations=7)
            loss = tf.reduce_sum(tf.square(outs.stack())) + tf.reduce_sum(h)
            fetches = [loss] + gradients(loss, [x, w])
            recorded.append(_rerun_iterations(graph))
            with tf.compat.v1.Session(graph=graph) as session:
                results.append(session.run(fetches, dict(zip([x, w], feeds))))
    assert recorded[0] == (1, 7)
    for ours, stock in zip(*results):
        np.testing.assert_allclose(ours, stock, rtol=1e-5, atol=1e-6)


def test_second_gradients_call_reuses_the_saved_states(chunk_size):
    """Two gradients calls on one loop: the forward op is changed once."""
    chunk_size(3)
    rnn = _Rnn(1)

    def build(x):
        loss, xs, h = rnn(x)
        again = msg.gradients(loss, xs, checkpoints="memory")
        return loss + tf.stop_gradient(tf.add_n([tf.reduce_sum(g) for g in again])) * 0.0, xs, h

    graph = _ours_alone_vs_stock(build, [tf.constant(_normal((2, 7, 3)))])
    assert _rerun_iterations(graph) == (1, 14)


class _RunningSum:
    """A loop carrying h and a scalar running sum of |h|, which the loss weighs
    by a constant (an adaptive-computation 'ponder cost'): the sum's gradient
    is a constant carried unchanged through each chunk's gradient loop."""

    def __init__(self):
        self.w = tf.Variable(_normal((5, 5), 0.4, seed=2))

    def __call__(self, x):
        steps = x.shape[1]

        def body(t, h, total):
            h = tf.tanh(tf.matmul(h, self.w) + x[:, t])
            return t + 1, h, total + tf.reduce_mean(tf.abs(h))

        _, h, total = tf.while_loop(lambda t, *_: t < steps, body,
                                    [tf.constant(0), tf.zeros([x.shape[0], 5]), tf.constant(0.0)],
                                    maximum_iterations=steps)
        return tf.reduce_sum(h * h) + 0.1 * total, [x, self.w], h


@pytest.mark.parametrize("jit", [False, True])
def test_a_constant_gradient_carried_through_the_chunks(chunk_size, jit):
    # Found by a review: under XLA this failed to compile ("Propagate: Cannot
    # find body function ..._const_0"): XLA's bridge propagates the constant
    # into the chunk's gradient loop and loses the body it made
    # (loop_rerun._unfoldable).
    chunk_size(3)
    _ours_alone_vs_stock(_RunningSum(), [tf.constant(_normal((2, 7, 5)))], jit=jit)


def _saved_state_reads(graph):
    """The reads of states a forward loop saved (loop_replay._saved_state)."""
    name = loop_replay.SAVED_STATE_GRADIENT.encode()
    return [op for op in graph.get_operations()
            if op.node_def.attr["_gradient_op_type"].s == name]


def _second_order_case(case):
    """(loss of w, w) for `case`: a loop chunked by ours where it is
    ('in place', 'stopped early', 'autograph': no maximum_iterations, 'bound
    at run time': read from a variable) or recomputed by the plan from its
    forward outputs ('copied')."""
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(8, 8)).astype(np.float32) * 0.3)
    x = tf.constant(rng.normal(size=(4, 8)).astype(np.float32))
    if case == "copied":
        rnn = _Rnn(1)
        return lambda: rnn(tf.constant(_normal((2, 7, 3))))[0], [rnn.w, rnn.u]

    length = tf.Variable(16)

    def loss():
        if case == "in place":
            h = tf.while_loop(lambda h: True, lambda h: tf.tanh(h @ w), [x],
                              maximum_iterations=16)[0]
        elif case == "bound at run time":
            h = tf.while_loop(lambda h: True, lambda h: tf.tanh(h @ w), [x],
                              maximum_iterations=length.read_value())[0]
        elif case == "stopped early":  # after 9 iterations, in its third chunk
            h = tf.while_loop(lambda h: tf.reduce_sum(h * h) < 60.0,
                              lambda h: tf.tanh(h @ w) + h, [x], maximum_iterations=16)[0]
        else:
            h = x
            for _ in tf.range(13):
                h = tf.tanh(h @ w) + 0.1 * h
        return tf.reduce_sum(h ** 2)
    return loss, [w]


@pytest.mark.parametrize("case,jit", [
    ("in place", False), ("stopped early", False), ("autograph", False), ("copied", False),
    ("bound at run time", False), pytest.param("in place", True, marks=pytest.mark.slow)])
def test_a_second_order_through_replayed_chunks_matches_tf_gradients(chunk_size, runtime_chunks,
                                                                     case, jit):
    # A gradient penalty over our gradients of a loop replayed from the states
    # its forward pass saved: differentiated through the recording lists it
    # came out 19% off (and was refused since); a saved state's gradient now
    # reruns the iterations before its chunk.
    chunk_size(4)
    runtime_chunks(3)  # of 6, 6 and 4 iterations
    loss, weights = _second_order_case(case)

    def second_order(differentiate):
        grads = differentiate(loss(), weights)
        return tf.gradients(tf.add_n([tf.reduce_sum(g * g) for g in grads]), weights)

    ours = tf.function(lambda: second_order(
        lambda y, xs: msg.gradients(y, xs, checkpoints="memory")), jit_compile=jit)
    for mine, theirs in zip(ours(), tf.function(lambda: second_order(tf.gradients))()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-6)
    assert _saved_state_reads(ours.get_concrete_function().graph)


def test_a_tape_recording_the_loop_and_our_gradients_gets_stock_gradients(chunk_size, caplog):
    # The forward loop and our gradients inside an outer GradientTape, which
    # then differentiates them. The tape would record our ops as they are made,
    # before the rewrite rewires some, and a review found its second order
    # wrong (a recorded tanh chain: up to 4x off), so `gradients` runs as
    # tf.gradients there and says so.
    chunk_size(2)
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(6, 6)) * 0.3)
    x = tf.constant(rng.normal(size=(3, 6)))

    def penalty_gradient(differentiate):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                h = tf.while_loop(lambda h: True, lambda h: tf.tanh(h @ w), [x],
                                  maximum_iterations=9)[0]
                (g,) = differentiate(tf.reduce_sum(h ** 2), [w])
                penalty = tf.reduce_sum(g * g)
            return tape.gradient(penalty, w)
        return step

    ours = penalty_gradient(lambda y, xs: msg.gradients(y, xs, checkpoints="memory"))
    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        np.testing.assert_allclose(ours(), penalty_gradient(tf.gradients)(), rtol=1e-10)
    assert "tf.gradients is used, without recomputation" in caplog.text
    assert not _chunk_loops(ours.get_concrete_function().graph)


@pytest.mark.parametrize("outer_loops", ["rerun", "default"])
def test_our_gradients_of_our_gradients_through_chunked_loops_run_as_tf_gradients(
        chunk_size, monkeypatch, caplog, outer_loops):
    # A gradient penalty over a Keras LSTM's gradients, both calls ours: the
    # outer plan recomputed the loops the first call made; TF refused the step
    # ("nodes in a cycle"), and with the loops rerun in chains the second order
    # came out wrong (a review: up to 100% off). The outer call now runs as
    # tf.gradients, saying why.
    from memory_saving_gradients.core import loop_plans
    from memory_saving_gradients.core.planning import LoopModes
    chunk_size(4)
    if outer_loops == "rerun":
        monkeypatch.setattr(loop_plans, "settings", lambda model: [LoopModes()])
    tf.keras.utils.set_random_seed(0)
    layer = tf.keras.layers.LSTM(6, return_sequences=True)
    x = tf.constant(_normal((3, 12, 4)))
    layer.build(x.shape)
    weights = layer.trainable_weights

    def penalty(first, second):
        grads = first(tf.reduce_sum(tf.square(layer(x))), weights)
        return second(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads]), weights)

    def ours(y, xs):
        return msg.gradients(y, xs, checkpoints="memory")

    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        found = tf.function(lambda: penalty(ours, ours))()
    assert "through the loops it made" in caplog.text
    expected = tf.function(lambda: penalty(tf.gradients, tf.gradients))()
    for a, b in zip(found, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_chains_rerun_in_turn_never_wait_in_a_cycle():
    # Three chains' gradients recorded in the order A, B, C, where A's rerun
    # reads C's outputs and B's ops were made before C's: B waits for A; C
    # must not wait for B (A's gradients need C's rerun, and B now waits for
    # them). A review found a walk back over the ops made after C missed that
    # path, through B's wait, and TF refused the graph ("contains a cycle").
    from memory_saving_gradients.tfgraph import gradient_waits
    from memory_saving_gradients.tfgraph import loop_rerun
    graph = tf.Graph()
    with graph.as_default():
        start = tf.constant([1.0, 2.0])
        # Stand-ins for chunk loops: the wait ties a float input after the
        # first two (a While's counter and bound).
        b_rerun = tf.raw_ops.AddN(inputs=[start] * 3).op
        b_grads = [b_rerun.outputs[0] * 2.0 + 1.0]
        c_rerun = tf.raw_ops.AddN(inputs=[start] * 3).op
        a_rerun = tf.raw_ops.AddN(inputs=[c_rerun.outputs[0]] * 3).op
        a_grads = [a_rerun.outputs[0] + 1.0]
        c_grads = [c_rerun.outputs[0] + 1.0]
        with loop_rerun.loop_gradients_in_turn():
            for rerun, grads in ((a_rerun, a_grads), (b_rerun, b_grads), (c_rerun, c_grads)):
                loop_rerun.rerun_in_turn(rerun)
                loop_rerun.chain_differentiated(rerun, grads)
            loop_rerun.start_reruns_in_turn(graph)
        assert gradient_waits.depends_on(b_rerun, a_grads[0].op)
        assert not gradient_waits.depends_on(c_rerun, b_grads[0].op)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(a_grads + b_grads + c_grads)
