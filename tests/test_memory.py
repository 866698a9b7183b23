"""Measured memory: the rewrite really saves activations.

Graph-mode peaks come from the allocation records of a traced Session run.
With 250,000-float tensors one unit is 1 MB, so peaks are counted in units.
"""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from models import residual_block
from models import tanh_block
from benchmarks.live_set_diff import allocator_events
from benchmarks.live_set_diff import requested_peak

UNIT = 250_000  # floats: 1 MB per tensor
MB = 1_000_000


def _session(optimized, inter_op_threads=0):
    """A Session; with `inter_op_threads`, running on a thread pool of its own
    that size (`use_per_session_threads`), else the process's."""
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter_op_threads,
                                      use_per_session_threads=bool(inter_op_threads))
    if not optimized:
        config.graph_options.optimizer_options.opt_level = tf.compat.v1.OptimizerOptions.L0
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    return tf.compat.v1.Session(config=config)


def _chain_peaks(depth, block, checkpoints, optimized=True, inter_op_threads=0):
    """Peak bytes of tf.gradients and of ours on a chain of `depth` blocks."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [UNIT])
        nodes = [x]
        for _ in range(depth):
            nodes.append(block(nodes[-1]))
        y = tf.reduce_sum(nodes[-1])
        stock = tf.gradients(y, x)
        chosen = checkpoints(nodes) if callable(checkpoints) else checkpoints
        ours = msg.gradients(y, x, checkpoints=chosen)
        feed = {x: np.random.RandomState(0).randn(UNIT).astype(np.float32) * 0.1}
        with _session(optimized, inter_op_threads) as sess:
            # The least of three calls each: with the other xdist worker busy, the
            # executor may keep a 1 MB tensor more (100 residual blocks, Grappler
            # off: 17.7 MB in CI; the plan the same as on 8f89942's code), and
            # stock once kept 1.7 MB more on 20 tanh blocks (session 54's CI).
            stock_peak, stock_val = _least(sess, stock, feed)
            ours_peak, ours_val = _least(sess, ours, feed)
    np.testing.assert_allclose(ours_val[0], stock_val[0], rtol=1e-5, atol=1e-6)
    return stock_peak, ours_peak


def _least(sess, fetches, feed):
    """`session_peak_bytes`' run of least peak among three."""
    return min((msg.session_peak_bytes(sess, fetches, feed) for _ in range(3)),
               key=lambda run: run[0])


@pytest.mark.parametrize("optimized", [True, False], ids=["grappler_on", "grappler_off"])
def test_explicit_checkpoints_save_a_unit_on_five_node_chain(optimized):
    stock, ours = _chain_peaks(5, tanh_block, lambda n: [n[2], n[4]], optimized)
    assert stock >= 5 * MB
    assert ours <= stock - MB, (stock, ours)


@pytest.mark.parametrize("optimized", [True, False], ids=["grappler_on", "grappler_off"])
@pytest.mark.parametrize("block", [tanh_block, residual_block], ids=["chain", "residual"])
def test_memory_mode_beats_the_tf1_tool_on_100_blocks(block, optimized):
    """The TF1 tool's own test: it peaked at 20 MB (18 MB with its other
    strategy). Intervals shrinking towards the loss (about sqrt(2n) tensors
    alive, not 2 sqrt(n)) measure 14-15 MB alone; with the other xdist worker
    busy the executor kept one or two 1 MB tensors more in all three runs
    (17.2 and 17.7 MB in CI, residual blocks, Grappler off), so the line is
    #15's target, 18 MB."""
    stock, ours = _chain_peaks(100, block, "memory", optimized)
    assert stock >= 100 * MB
    assert ours <= 18 * MB, (stock, ours)


@pytest.mark.parametrize("inter_op_threads", [1, 8])
def test_memory_mode_holds_on_a_sessions_own_thread_pool(inter_op_threads):
    """The order is enforced by the rewrite, not left to the executor: one
    thread or eight (more than the cores, as on a larger machine), the 100
    residual blocks measured 14 MB (stock 100) in session 56."""
    stock, ours = _chain_peaks(100, residual_block, "memory", inter_op_threads=inter_op_threads)
    assert stock >= 100 * MB
    assert ours <= 18 * MB, (stock, ours)


def test_collection_mode_keeps_collected_tensors():
    def every_tenth(nodes):
        for h in nodes[10::10]:
            tf.compat.v1.add_to_collection("checkpoints", h)
        return "collection"

    stock, ours = _chain_peaks(100, tanh_block, every_tenth)
    assert ours <= 25 * MB, (stock, ours)


def test_empty_collection_behaves_like_tf_gradients():
    stock, ours = _chain_peaks(20, tanh_block, "collection")
    assert abs(ours - stock) <= MB


def _steps(forward, weights, jit_compile):
    """tf.gradients' and 'memory''s tf.function steps `inputs -> weight gradients`."""
    def make_step(grad_fn):
        @tf.function(jit_compile=jit_compile)
        def step(inputs):
            return grad_fn(forward(inputs), weights)
        return step
    return make_step(tf.gradients), make_step(msg.gradients_memory)


def _weight_bytes(weights):
    return sum(w.shape.num_elements() * w.dtype.size for w in weights)


def _activation_bytes(forward, weights, x):
    """Activation memory (peak of bytes requested minus weight gradients) of a
    tf.function step `forward(x) -> loss` under tf.gradients and under
    'memory', in this process; checks the gradients agree. Returns (stock,
    ours). Bytes requested, not the allocator's peak: in a process that ran
    other tests BFC can hand a buffer a free chunk up to twice its size (the
    RNN stack below read 0.66 against 0.7 with 7.96 MiB free chunks made first)."""
    stock_step, ours_step = _steps(forward, weights, jit_compile=False)
    for a, b in zip(stock_step(x), ours_step(x)):  # also traces outside the measurement
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-6)
    return (_requested_bytes(stock_step, x) - _weight_bytes(weights),
            _requested_bytes(ours_step, x) - _weight_bytes(weights))


def _requested_bytes(step, x):
    """Peak of the bytes a call of `step` asked the allocator for (profiled)."""
    return requested_peak(allocator_events(lambda inputs, _: step(inputs), x, None))


def _residual_mlp():
    """(forward, weights, x) of a 24-block residual MLP."""
    depth, width, batch = 24, 256, 512
    rng = tf.random.Generator.from_seed(1)
    weights = [tf.Variable(rng.normal([width, width], stddev=0.03)) for _ in range(depth)]

    def forward(h):
        for w in weights:
            h = h + tf.nn.relu(tf.matmul(h, w))
        return tf.reduce_mean(h * h)

    return forward, weights, rng.normal([batch, width])


def test_tf_function_residual_mlp_halves_activation_memory():
    stock, ours = _activation_bytes(*_residual_mlp())
    assert ours * 2 <= stock, (stock, ours)


def test_xla_residual_mlp_halves_activation_memory():
    """Under XLA too: copies wait for the gradient by a data dependency there.

    Counted in bytes requested, not in the allocator's peak: XLA asks for all
    of a step's temporaries as one buffer (24.5 MiB for tf.gradients, 8.5 MiB
    for ours here), and the BFC allocator hands out a free chunk whole when it
    is less than twice the request. Which free chunks exist depends on what the
    process ran before: in a fresh process tf.gradients' buffer took a new
    32 MiB region (peak 33.5 MB against ours 8.9), late in the whole suite ours
    took a chunk of about 17 MB left by earlier tests (17.6 against 25.7), with
    the same plan and the same optimized HLO. The bytes requested do not
    depend on that history, which the second measurement of ours checks."""
    forward, weights, x = _residual_mlp()
    stock, ours, ours_step = _xla_activation_bytes(forward, weights, x)
    assert ours * 2 <= stock, (stock, ours)
    free_chunk = tf.zeros([int(1.9 * ours) // 4])  # between one and two of ours' buffer
    del free_chunk
    assert _requested_bytes(ours_step, x) - _weight_bytes(weights) == ours


def _small_unet():
    """(forward, weights, x) of a one-level U-Net: conv-ReLU pairs, a 2x2 max
    pool, a 2x2 stride-2 transposed convolution and a concatenated skip."""
    batch, pixels, width = 8, 64, 16
    rng = tf.random.Generator.from_seed(3)

    def conv_w(k, cin, cout):
        return tf.Variable(rng.normal([k, k, cin, cout], stddev=(2.0 / (k * k * cin)) ** 0.5))

    down = [conv_w(3, 3, width), conv_w(3, width, width)]
    bottom = [conv_w(3, width, 2 * width), conv_w(3, 2 * width, 2 * width)]
    up = conv_w(2, width, 2 * width)
    top = [conv_w(3, 2 * width, width), conv_w(3, width, width)]
    head = conv_w(1, width, 3)

    def stage(h, ws):
        for w in ws:
            h = tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))
        return h

    def forward(x):
        skip = stage(x, down)
        h = stage(tf.nn.max_pool2d(skip, 2, 2, "VALID"), bottom)
        h = tf.nn.conv2d_transpose(h, up, tf.shape(skip), 2, "VALID")
        logits = tf.nn.conv2d(stage(tf.concat([h, skip], axis=-1), top), head, 1, "SAME")
        return tf.reduce_mean(logits * logits)

    return forward, down + bottom + [up] + top + [head], rng.normal([batch, pixels, pixels, 3])


def test_xla_small_unet_saves_activation_memory():
    """A recomputed max pool's gradient runs in backprop; XLA's own (a
    select-and-scatter) then held four s32 index arrays of the pool's input
    from the step's first instruction to there: ours requested 29.4 MiB
    against tf.gradients' 27.3 before pool_gradients.py, 19.4 after."""
    stock, ours, _ = _xla_activation_bytes(*_small_unet())
    assert ours <= 0.8 * stock, (stock, ours)


def _xla_activation_bytes(forward, weights, x):
    """(tf.gradients', ours) bytes requested at the peak of a jit-compiled step,
    weights left out, after checking that the gradients agree; and our step."""
    stock_step, ours_step = _steps(forward, weights, jit_compile=True)
    for a, b in zip(stock_step(x), ours_step(x)):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-6)
    stock, ours = (_requested_bytes(step, x) - _weight_bytes(weights)
                   for step in (stock_step, ours_step))
    return stock, ours, ours_step


def test_tf_function_rnn_stack_recomputes_its_loops():
    """Each layer is a tf.while_loop reading its weights in the body (as Keras'
    LSTM): tf.gradients keeps every layer's per-step state until backprop
    reaches it; rerunning each loop late keeps one layer's at a time."""
    layers, steps, batch, width = 6, 32, 256, 128
    rng = tf.random.Generator.from_seed(2)
    weights = [tf.Variable(rng.normal([2 * width, width], stddev=0.05))
               for _ in range(layers)]

    def rnn(inputs, w):
        def body(t, h, outs):
            h = tf.tanh(tf.matmul(tf.concat([inputs[t], h], axis=1), w))
            return t + 1, h, outs.write(t, h)
        _, _, outs = tf.while_loop(lambda t, h, outs: t < steps, body, [
            tf.constant(0), tf.zeros([batch, width]), tf.TensorArray(tf.float32, steps)])
        return outs.stack()

    def forward(h):
        for w in weights:
            h = rnn(h, w)
        return tf.reduce_mean(h * h)

    stock, ours = _activation_bytes(forward, weights, rng.normal([steps, batch, width]))
    assert ours <= 0.7 * stock, (stock, ours)  # measured: about 0.5


def test_memory_mode_without_bottleneck_saves_and_does_not_warn(caplog):
    """Parallel towers joined only at the loss have no single-tensor bottleneck
    (the graph shape that made the TF1 tool raise). Cuts of the topological
    order exist on every graph, so there is nothing for the user to act on:
    the plan is logged at INFO, never as a warning."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [UNIT])
        towers = []
        for scale in (1.0, 0.5):
            h = x * scale
            for _ in range(40):
                h = tf.tanh(h)
            towers.append(h)
        y = tf.reduce_sum(towers[0] * towers[1])
        stock = tf.gradients(y, x)
        with caplog.at_level("INFO", logger="memory_saving_gradients"):
            ours = msg.gradients(y, x, checkpoints="memory")
        assert "strategy memory keeps" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        feed = {x: np.random.RandomState(0).randn(UNIT).astype(np.float32)}
        with _session(optimized=True) as sess:
            stock_peak, stock_val = msg.session_peak_bytes(sess, stock, feed)
            ours_peak, ours_val = msg.session_peak_bytes(sess, ours, feed)
    np.testing.assert_allclose(ours_val[0], stock_val[0], rtol=1e-5, atol=1e-6)
    assert stock_peak >= 80 * MB
    assert ours_peak <= stock_peak / 2, (stock_peak, ours_peak)


_MEASURE_ONE_CALL = """
import tensorflow as tf
import memory_saving_gradients as msg
if {enable}:
    msg.enable_cpu_allocator_stats()
step = tf.function(lambda x: tf.tanh(x) * 2.0)
x = tf.ones([250_000])
step(x)
try:
    print("peak", msg.function_peak_bytes(step, x)[0])
except RuntimeError as error:
    print("error", error)
"""


@pytest.mark.parametrize("enable", [True, False], ids=["enabled", "default_allocator"])
def test_function_peak_needs_allocator_stats_and_says_how(enable):
    """A fresh process, as TensorFlow picks its CPU allocator once; oneDNN off,
    so the default allocator keeps no statistics on any CPU."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    # The child imports tests/models.py.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                      env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _MEASURE_ONE_CALL.format(enable=enable)],
                         env=env, capture_output=True, text=True, check=True).stdout
    if enable:
        assert int(out.split()[-1]) >= MB, out  # at least the 1 MB result
    else:
        assert "enable_cpu_allocator_stats()" in out and "TF_CPU_ALLOCATOR_USE_BFC=1" in out
