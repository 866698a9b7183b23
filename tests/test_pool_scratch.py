"""A max pool's gradient kernel takes the pool's output for its scratch where it reads it last.

TensorFlow's CPU `MaxPoolGrad` copies the pool's output into a temporary,
or writes over that output's buffer when nothing else holds it
(`forward_input_or_allocate_temp`). Its measured workspace
(`workspace.py`, the output fed, so held) counts the copy; the timeline
takes it back where the pool's output dies in the kernel's step
(`workspace.gradient_scratch_forwards`), in the rewrite's order only: under
stock, the next layer's weight gradient or a skip connection may read the
output after the kernel or beside it. Before, a chain of max pools under
`"memory"` was predicted a whole pool output above measured, and
InceptionV3's `"memory"` plan 1.06x its measured activation peak. Measured in a
fresh process (`module_result`), both threadings.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import module_result

from memory_saving_gradients.tfgraph import workspace

MIB = 2 ** 20
SHAPE = (8, 32, 32, 32)  # NHWC, float32: 1 MiB


def test_the_kernel_takes_the_pool_output_it_reads_last():
    graph = tf.Graph()
    with graph.as_default():
        image = tf.compat.v1.placeholder(tf.float32, SHAPE)
        pooled = tf.nn.max_pool2d(image, 3, 2, "VALID")
        taken = workspace.gradient_scratch_forwards(pooled.op)
        # Its input gradient alone is built (`differentiated`): still the same kernel.
        assert workspace.gradient_scratch_forwards(pooled.op, [True]) == taken
    output_bytes = pooled.shape.num_elements() * 4
    if not taken:
        pytest.skip("this host's MaxPoolGrad copies the pool's output whoever holds it")
    assert taken == ((("output", 0), output_bytes),)
    assert workspace.gradient_workspace_bytes(pooled.op) >= output_bytes


def test_ops_without_such_a_kernel_take_nothing():
    graph = tf.Graph()
    with graph.as_default():
        image = tf.compat.v1.placeholder(tf.float32, SHAPE)
        assert workspace.gradient_scratch_forwards(tf.nn.avg_pool2d(image, 2, 2, "VALID").op) == ()
        assert workspace.gradient_scratch_forwards(tf.nn.relu(image).op) == ()


def _pool_chain_step(plan, skip):
    """Six blocks of a channel scale, tanh and a 3x3 max pool of stride 1 over
    1 MiB images in a tf.function (with `skip`, the first pool's output added
    to the last one's), its gradients by `plan`; (predicted, measured) bytes
    of the activation peak (bytes requested, profiled, the weight gradients
    left out: `step_peaks`' count)."""
    from benchmarks.live_set_diff import activation_peak, allocator_events
    import memory_saving_gradients as msg
    from memory_saving_gradients.core import timeline

    weights = [tf.Variable(tf.fill(SHAPE[-1:], 1.0 + k / 10)) for k in range(6)]
    x = tf.constant(np.random.default_rng(0).normal(size=SHAPE).astype(np.float32))

    def loss(x):
        pools = [x]
        for w in weights:
            pools.append(tf.nn.max_pool2d(tf.tanh(pools[-1] * w), 3, 1, "SAME"))
        h = pools[-1] + pools[1] if skip else pools[-1]
        return tf.reduce_sum(tf.square(tf.reduce_sum(h, axis=[1, 2])))

    @tf.function
    def step(x, _):
        y = loss(x)
        return (msg.gradients(y, weights, checkpoints=plan) if plan
                else tf.gradients(y, weights))

    holder = {}

    @tf.function
    def predict(x):
        holder["plan"] = msg.checkpoint_plan(loss(x), weights, checkpoints=plan or "memory")
        return tf.constant(0.0)

    predict.get_concrete_function(tf.TensorSpec(SHAPE, tf.float32))
    found = holder["plan"]
    _, predicted = timeline.step_peaks(found.model, found.plan if plan else None)
    step(x, None)
    return int(predicted), int(activation_peak(allocator_events(step, x, None)))


@pytest.fixture(scope="module", params=["default", "1"])
def measured(request):
    """`_measure_all` from a fresh process, with either threading; and that threading."""
    return {**module_result("tests.test_pool_scratch", request.param), "threads": request.param}


@pytest.mark.parametrize("skip", [False, True], ids=["chain", "skip"])
def test_memory_on_a_chain_of_max_pools_is_predicted_to_a_quarter_of_a_pool_output(
        measured, skip):
    # Measured 9.0 MiB on the chain, predicted to the byte; 10.0 before the
    # take-over was modelled.
    predicted, peak = measured[f"memory {skip}"]
    assert abs(predicted - peak) <= 0.25 * MIB, (predicted / MIB, peak / MIB)


@pytest.mark.parametrize("skip", [False, True], ids=["chain", "skip"])
def test_stock_is_not_predicted_below_measured(measured, skip):
    # Stock's order does not make the kernel read the pool's output last, so
    # its copy is counted: on the chain measured 16.0-17.0 MiB, predicted 17.0;
    # with the skip connection and one thread measured 17.0, predicted 16.0
    # when the take-over applied to stock too (a review's finding). With
    # several threads the skip chain measured 18.0, above the 17.0 replayed
    # one op at a time, as before this change: not asserted.
    if skip and measured["threads"] != "1":
        pytest.skip("stock's order with several threads is not what the timeline replays")
    predicted, peak = measured[f"stock {skip}"]
    assert 0 <= predicted - peak <= 1.25 * MIB, (predicted / MIB, peak / MIB)


def _measure_all():
    return {f"{plan} {skip}": _pool_chain_step(None if plan == "stock" else plan, skip)
            for plan in ("stock", "memory") for skip in (False, True)}


if __name__ == "__main__":  # `module_result` passes the suite's environment on
    print(json.dumps(_measure_all()))
