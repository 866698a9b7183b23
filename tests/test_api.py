"""The public API: argument handling, errors, plan inspection (monkey-patching:
test_api_patching.py)."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from harness import run_session


def test_eager_call_says_to_use_tf_function():
    with pytest.raises(RuntimeError, match="tf.function"):
        msg.gradients(tf.constant(1.0), [tf.constant(2.0)])


def test_unknown_mode_is_named(chain):
    x, _, y = chain
    with pytest.raises(ValueError, match="unknown checkpoints mode 'fastest'"):
        msg.gradients(y, x, checkpoints="fastest")


@pytest.mark.parametrize("bad", [[np.ones(3)], [3.0], ["h"], 42])
def test_checkpoint_that_is_not_a_tensor_is_a_type_error(chain, bad):
    x, _, y = chain
    with pytest.raises(TypeError, match="checkpoints"):
        msg.gradients(y, x, checkpoints=bad)


def test_checkpoint_from_another_graph(chain):
    x, _, y = chain
    with tf.Graph().as_default():
        other = tf.compat.v1.placeholder(tf.float32, [8])
    with pytest.raises(ValueError, match="different graph"):
        msg.gradients(y, x, checkpoints=[other])


def test_xs_from_another_graph(chain):
    _, _, y = chain
    with tf.Graph().as_default():
        other = tf.compat.v1.placeholder(tf.float32, [8])
    with pytest.raises(ValueError, match="different graph"):
        msg.gradients(y, other)


def test_checkpoint_not_between_xs_and_ys(chain):
    x, hs, y = chain
    unrelated = tf.compat.v1.placeholder(tf.float32, [8]) * 2.0
    with pytest.raises(ValueError, match="not between xs and ys"):
        msg.gradients(y, x, checkpoints=[unrelated])
    with pytest.raises(ValueError, match="not between xs and ys"):
        msg.gradients(hs[2], x, checkpoints=[hs[4]])  # downstream of the y


def test_unexpected_keyword_is_a_type_error(chain):
    x, _, y = chain
    with pytest.raises(TypeError, match="checkpionts"):
        msg.gradients(y, x, checkpionts="memory")


def test_grad_ys_length_must_match(chain):
    x, hs, y = chain
    with pytest.raises(ValueError, match="grad_ys has 2 entries"):
        msg.gradients(y, x, grad_ys=[tf.ones([]), tf.ones([])])


def test_checkpoint_inside_while_loop_body_is_rejected():
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.disable_control_flow_v2()
        try:
            x = tf.compat.v1.placeholder(tf.float32, [4])
            inner = []

            def body(i, h):
                h = tf.tanh(h)
                inner.append(h)
                return i + 1, h

            _, out = tf.while_loop(lambda i, h: i < 3, body, [0, x])
            y = tf.reduce_sum(tf.tanh(out))
            with pytest.raises(ValueError, match="while_loop"):
                msg.gradients(y, x, checkpoints=[inner[0]])
        finally:
            tf.compat.v1.enable_control_flow_v2()


def test_single_x_and_list_return_like_tf_gradients(chain):
    x, hs, y = chain
    grads = msg.gradients(y, x, checkpoints=[hs[2]])
    assert isinstance(grads, list) and len(grads) == 1
    feed = {x: np.linspace(-1, 1, 8).astype(np.float32)}
    stock, ours = run_session([tf.gradients(y, x), grads], feed)
    np.testing.assert_allclose(ours[0], stock[0], rtol=1e-6)


def test_plan_inspection_adds_no_ops_and_reports_recompute(chain):
    x, hs, y = chain
    graph = y.graph
    before = len(graph.get_operations())
    plan = msg.checkpoint_plan(y, x, "memory")
    assert len(graph.get_operations()) == before
    assert plan.mode == "memory"
    assert 1 <= len(plan.checkpoints) < 6
    assert all(t in hs for t in plan.checkpoints)
    assert plan.num_recomputed_ops > 0
    assert plan.estimate.peak_bytes < plan.estimate.baseline_bytes
    assert "recompute" in str(plan)


def test_plan_reports_the_allocator_level_peaks(chain):
    x, _, y = chain
    estimate = msg.checkpoint_plan(y, x, "memory").estimate
    # Chunks are whole multiples of 256 bytes, never less than the bytes requested.
    assert estimate.allocator_peak_bytes >= estimate.peak_bytes
    assert estimate.allocator_baseline_bytes >= estimate.baseline_bytes
    assert "as the allocator counts it" in str(msg.checkpoint_plan(y, x, "memory"))


def test_chosen_checkpoints_are_logged(chain, caplog):
    x, hs, y = chain
    with caplog.at_level(logging.INFO, logger="memory_saving_gradients"):
        msg.gradients(y, x, checkpoints=[hs[2]])
    assert hs[2].name in caplog.text


def test_keras_variables_are_accepted_as_xs():
    import keras
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(16, activation="tanh") for _ in range(6)]
    inputs = tf.random.stateless_normal([4, 16], seed=[1, 2])
    for layer in layers:
        layer.build((None, 16))
    weights = [w for layer in layers for w in layer.trainable_weights]

    def step(grad_fn):
        h = inputs
        for layer in layers:
            h = layer(h)
        return grad_fn(tf.reduce_sum(h * h), weights)

    stock = tf.function(lambda: step(lambda y, xs: tf.gradients(y, [w.value for w in xs])))()
    ours = tf.function(lambda: step(msg.gradients_memory))()
    assert len(ours) == len(weights) and all(g is not None for g in ours)
    for a, b in zip(stock, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5)


# --- unclear or late errors (issue 14) -----------------------------------------

def test_single_stop_gradients_tensor_like_tf_gradients(chain):
    x, hs, y = chain
    y = y + tf.reduce_sum(hs[1] * hs[1])  # a path from x around the stop
    ours = msg.gradients(y, x, checkpoints=[hs[1]], stop_gradients=hs[3])
    stock = tf.compat.v1.gradients(y, x, stop_gradients=hs[3])
    feed = {x: np.linspace(-1, 1, 8).astype(np.float32)}
    np.testing.assert_allclose(*run_session([ours[0], stock[0]], feed), rtol=1e-6)


@pytest.mark.parametrize("seed", [[1.0], 1.0, np.float32(2.0), np.array(3.0)])
def test_grad_ys_python_and_numpy_values_like_tf_gradients(chain, seed):
    x, hs, y = chain
    ours = msg.gradients(y, x, grad_ys=seed, checkpoints=[hs[2]])
    # tf.gradients keeps a numpy array's float64, which then fails in float32 ops.
    stock = tf.compat.v1.gradients(y, x, grad_ys=tf.constant(np.ravel(seed)[0], tf.float32))
    feed = {x: np.linspace(-1, 1, 8).astype(np.float32)}
    np.testing.assert_allclose(*run_session([ours[0], stock[0]], feed), rtol=1e-6)


def test_grad_ys_of_the_wrong_shape_is_named():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3, 4])
        y = tf.tanh(x)
        with pytest.raises(ValueError, match=r"grad_ys\[0\] has shape \(4, 3\)"):
            msg.gradients(y, x, grad_ys=[tf.ones([4, 3])])


@pytest.mark.parametrize("seed", [lambda: tf.ones([8], tf.float64), lambda: np.array(["a"] * 8)])
def test_grad_ys_of_the_wrong_dtype_is_named(seed):
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8])
        y = tf.tanh(x)
        with pytest.raises(TypeError, match=r"grad_ys\[0\]"):
            msg.gradients(y, x, grad_ys=[seed()])


def test_unconnected_gradients_typo_names_the_argument_and_values(chain):
    x, _, y = chain
    with pytest.raises(ValueError, match="unconnected_gradients='zeros'.*'none' or 'zero'"):
        msg.gradients(y, x, unconnected_gradients="zeros")


def test_a_second_gradients_call_scans_only_the_ops_added_since(chain, monkeypatch):
    """Whole-graph scans are kept per graph and told only of new ops."""
    from memory_saving_gradients.tfgraph import reading
    scanned = []
    add_ops = reading.DataTensors.add_ops

    def counting(self, ops):
        scanned.append(len(ops))
        return add_ops(self, ops)

    monkeypatch.setattr(reading.DataTensors, "add_ops", counting)
    x, hs, y = chain
    graph = tf.compat.v1.get_default_graph()
    first = msg.gradients(y, x, checkpoints="memory")
    ops_after_first = len(graph.get_operations())
    second = msg.gradients(y, x, checkpoints="memory")
    assert scanned[0] < ops_after_first  # the first call scanned the forward graph
    assert scanned[1:] == [ops_after_first - scanned[0]]  # then only what it added
    feed = {x: np.linspace(-1, 1, 8).astype(np.float32)}
    np.testing.assert_allclose(*run_session([first[0], second[0]], feed))
