"""The memory model against TensorFlow's allocator, and the order the rewrite enforces.

Slow (several minutes on a shared 2-core machine): six fresh subprocesses, one per
small model (a CNN with batch norm, a four-block transformer encoder, an LSTM stack) and
threading (TensorFlow's default, and one inter-op thread), each measuring
tf.gradients and checkpoints='memory' on the same model and batch
(benchmarks/predicted_vs_measured.py: allocator peak of a tf.function step
minus its weight gradients, beside the prediction of `checkpoint_plan`; the
prediction in bytes requested against the profiled bytes requested).
"""

import pytest

from benchmarks import predicted_vs_measured as pvm

pytestmark = pytest.mark.slow

METHODS = ("tf.gradients", "memory")
THREADS = ("default", "1")


@pytest.fixture(scope="module")
def rows():
    found = {}
    for model in pvm.SMALL_MODELS:
        for threads in THREADS:
            for row in pvm.run_job(model, METHODS, threads, timeout=600, requested=True):
                assert "error" not in row, row
                found[model, row["method"], threads] = row
    return found


def _ratio(rows, model, threads):
    return (rows[model, "memory", threads]["measured"]
            / rows[model, "tf.gradients", threads]["measured"])


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model", ["cnn_bn", "lstm", "transformer"])
def test_predicted_peak_within_15_percent_of_measured(rows, model, method, threads):
    # Predicted/measured in bytes requested (session 36, docs/planner.md): the
    # CNN 1.00 for both; the transformer encoder 0.88 (tf.gradients, default
    # threading) to 1.01, since pruned gradient branches read nothing; the LSTM
    # stack 0.99-1.01: a TensorList has the bytes of its items, the first LSTM's
    # input list, made outside the region, lives until that loop's chunks have
    # rerun, and each chunk's gradient sums its weights' gradients in buffers of
    # their size. Not in BFC's chunks, which for one plan move with what the
    # process allocated before: the encoder's 'memory' plan, three calls in one
    # process, 8.2-9.6 MiB in chunks against 6.8-7.9 requested (6.8 predicted);
    # 7.0-8.9 in chunks in a CI run, which failed its 8.1 as BFC counts it by 3 KB.
    row = rows[model, method, threads]
    assert row["predicted"] == pytest.approx(row["requested"], rel=0.15), row


@pytest.mark.parametrize("model", ["cnn_bn", "transformer", "lstm"])
def test_saving_holds_with_one_inter_op_thread(rows, model):
    # Measured (MiB, 'memory' / tf.gradients): lstm 1.42/4.58 default, 1.48/4.40
    # one thread. The scratch-allocating gradient ops run one at a time
    # (tfgraph/gradient_order.py), so the CNN's plan no longer holds two
    # convolutions' scratch with default threading.
    single = _ratio(rows, model, "1")
    assert single < 0.9, f"{model}: 'memory' keeps {single:.2f} of tf.gradients"
    # Our peak moves by at most 0.1 of tf.gradients' between threadings. Not
    # the ratios' difference: tf.gradients' own one-thread peak moves between
    # processes, and that alone moved the ratio by 0.12 in a CI run. The
    # transformer has four blocks: with one block, whether one 2 MiB FFN
    # tensor happened to be alive at the peak moved ours by 0.13 of stock in
    # CI; a lost ordering grows with depth, that noise does not.
    ours = [rows[model, "memory", threads]["measured"] for threads in THREADS]
    stock = min(rows[model, "tf.gradients", threads]["measured"] for threads in THREADS)
    assert abs(ours[0] - ours[1]) <= 0.1 * stock, (model, ours, stock)


@pytest.mark.parametrize("threads", THREADS)
def test_stock_peak_within_the_executor_order_range(threads):
    # A residual MLP of 8 blocks (1024 x 128 floats a tensor). With one inter-op thread
    # TensorFlow's executor defers the weight and bias gradients its ready queue hands
    # over until the chain of data gradients stops, each holding its reads: requested
    # 12.0-12.5 MiB against 8.5 predicted by the one-op-at-a-time replay (0.68-0.71; the
    # 16-block MLP 23.1-23.5 against 15.5). Which gradients wait depends on the optimized graph's
    # out-edge order, which the op-level graph does not show, so the executor's order is
    # replayed for both (`timeline.stock_peak_range`): 8.9-16.0 MiB. With default threading
    # 8.1-8.9 here, 9.6 in a CI run under pytest-xdist, against 8.0-8.1 replayed with two
    # threads: a starved executor takes the one-thread order, so that range is included
    # (8.0-16.0). Bytes requested, not BFC's chunks.
    (row,) = pvm.run_job("mlp:8:1024", ["tf.gradients"], threads, timeout=600, requested=True)
    low, high = row["predicted_range"]
    assert 0.85 * low <= row["requested"] <= 1.15 * high, row


def test_stock_peak_with_one_inter_op_thread_defers_filter_gradients():
    # With one inter-op thread TensorFlow's own kernels' convolution filter gradients
    # wait until the chain of input gradients stops, each holding its image and its
    # incoming gradient; the replay in the executor's order
    # (GraphModel.deferred_weight_gradient_types, timeline.step_peaks) predicts it.
    # MobileNetV2 at 32 px, activation peak in bytes requested: 29.25 MiB measured,
    # 29.25 predicted (25.14, 0.86, one op at a time).
    (row,) = pvm.run_job("MobileNetV2:32:8", ["tf.gradients"], "1", timeout=600,
                         requested=True)
    assert row["predicted_activation"] == pytest.approx(row["requested_activation"],
                                                        rel=0.05), row


def test_hard_swish_gradients_run_in_backprop():
    # Keras' hard swish, x * (relu6(x + 3) / 6), differentiates into (g * x) / 6,
    # which Grappler's constant push-down rewrote g * (x / 6): x / 6 ran in the
    # forward pass, one per hard swish, each held until backprop reached it
    # (constant_push_down.py). MobileNetV3Small at 64 px, 'memory', activation
    # peak in bytes requested: 5.90 MiB measured against 4.55 predicted (0.77)
    # with them, 4.93 (0.92) without; 4.92 predicted (1.00) since the model counts
    # the rescaled image the stem's filter gradient reads (GraphModel.outside_reads).
    # Hoisted again, 5.90 against 4.92 would be 0.83.
    (row,) = pvm.run_job("MobileNetV3Small:64:8", ["memory"], "default", timeout=600,
                         requested=True)
    assert row["predicted_activation"] == pytest.approx(row["requested_activation"],
                                                        rel=0.08), row
