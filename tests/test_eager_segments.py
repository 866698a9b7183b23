"""Decorated layers called eagerly under a tape: through a tf.function of their own.

Each case compares the decorated layer with the same layer undecorated, both
run eagerly under a GradientTape with checkpointing in force (same seed, same
weights): gradients, losses, masks and outputs as without the function.
tests/test_backward_copies.py measures the memory ("eager layers").
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.integrations import eager_segments, layer_decorator
from memory_saving_gradients.keras import recompute_grad

RUNS_AS_WRITTEN = "runs eagerly and is not recomputed"


class Regularized(keras.layers.Layer):
    """Adds losses: one of its own, one by a sublayer's activity regularizer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4, activity_regularizer="l2")
        self.outer = keras.layers.Dense(4)

    def call(self, x):
        self.add_loss(0.5 * tf.reduce_mean(x * x))
        return self.outer(tf.tanh(self.inner(x)))


class Masked(keras.layers.Layer):
    """Its output carries the mask of an Embedding(mask_zero=True)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(10, 4, mask_zero=True)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        ids = tf.math.floormod(tf.cast(tf.abs(x[:, :3]) * 5.0, tf.int32), 10)
        return self.dense(self.embedding(ids))


class PythonValues(keras.layers.Layer):
    """Returns Python values beside a tensor (a tf.function would make them tensors)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return {"y": tf.tanh(self.dense(x)), "count": 3, "none": None, "name": "a"}


class ContextDropout(keras.layers.Layer):
    """Its dropout takes `training` from Keras's call context only."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(64)
        self.dropout = keras.layers.Dropout(0.5, seed=3)

    def call(self, x):
        return self.dropout(self.dense(x))


class AttributeScaled(keras.layers.Layer):
    """Reads a tensor and a Python number another layer (here: the test) sets
    on it before each call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.memory, self.temperature = None, 1.0

    def call(self, x):
        return self.dense(x * self.memory) / self.temperature


class MaskReader(keras.layers.Layer):
    """Pools its input under the mask the input carries (Keras passes no
    `mask=`: the pooling layer inside reads it off the tensor)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.pool = keras.layers.GlobalAveragePooling1D()

    def call(self, x):
        return self.pool(self.dense(x))


class KeepsScores(keras.layers.Layer):
    """Stores a tensor it computes on itself, for inspection."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        self.scores = tf.nn.softmax(self.dense(x))
        return self.scores * x[:, :4]


class LossThenUntraceable(Regularized):
    """Adds losses, then reads a value eagerly."""

    def call(self, x):
        y = super().call(x)
        return y if float(tf.reduce_sum(y).numpy()) > 1e9 else 2.0 * y


_TABLE = tf.random.stateless_normal([64, 6], seed=[9, 9])  # large: captured, not folded


class ReadsAGlobal(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return self.dense(x * tf.reduce_mean(_TABLE, axis=0))


def _decorated(layer_type):
    class Decorated(layer_type):
        @recompute_grad
        def call(self, x):
            return super().call(x)
    return Decorated


def _run(layer_type, x, call=lambda layer, x: layer(x), built_in_tape=False):
    """(gradients of x and the weights, the output, the layer's losses): a
    loss of the output (its "y") and the layer's losses, differentiated eagerly."""
    keras.utils.set_random_seed(0)
    layer = layer_type()
    if not built_in_tape:
        call(layer, x)
    with msg.checkpointing(), tf.GradientTape() as tape:
        tape.watch(x)
        out = call(layer, x)
        first = out["y"] if isinstance(out, dict) else out
        loss = tf.reduce_sum(first ** 2) + tf.add_n([0.0] + layer.losses)
    grads = tape.gradient(loss, [x] + layer.trainable_weights)
    return ([None if g is None else tf.convert_to_tensor(g).numpy() for g in grads], out,
            layer.losses)


def _assert_as_undecorated(layer_type, built_in_tape=False, call=lambda layer, x: layer(x)):
    x = tf.random.stateless_normal([8, 6], seed=[1, 2])
    want, want_out, want_losses = _run(layer_type, x, call, built_in_tape)
    got, got_out, got_losses = _run(_decorated(layer_type), x, call, built_in_tape)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert len(got_losses) == len(want_losses)
    for g, w in zip(got_losses, want_losses):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-7)
    return got_out, want_out


@pytest.fixture
def traced(monkeypatch):
    """The layers whose call went through a tf.function, once each."""
    layers = []
    original = eager_segments._TracedCall._traced
    monkeypatch.setattr(eager_segments._TracedCall, "_traced",
                        lambda self, *args: layers.append(self) or original(self, *args))
    monkeypatch.setattr(layer_decorator, "_logged", set())
    return layers


@pytest.mark.parametrize("built_in_tape", [False, True], ids=["built before", "built in tape"])
def test_losses_the_body_adds_are_the_layers_eager_losses(built_in_tape, traced):
    _assert_as_undecorated(Regularized, built_in_tape)
    assert traced


def test_a_keras_mask_on_an_output_comes_back():
    got, want = _assert_as_undecorated(Masked)
    assert want._keras_mask is not None
    np.testing.assert_array_equal(got._keras_mask.numpy(), want._keras_mask.numpy())


def test_python_values_come_back_as_python_values():
    got, _ = _assert_as_undecorated(PythonValues)
    assert (got["count"], got["none"], got["name"]) == (3, None, "a")


@pytest.mark.parametrize("training", [True, False, None])
def test_training_from_the_call_context_is_part_of_the_cache_key(training, traced):
    """A body's dropout reads `training` from an outer call's context, which
    the tf.function's arguments do not show: the masks and gradients are
    stock's whichever value comes first."""
    def call(layer, x):
        for value in (training, not training):
            out = layer(x, training=value)  # Keras sets the context from the keyword
        return out
    _assert_as_undecorated(ContextDropout, call=call)
    assert traced


def test_a_tensor_training_value_runs_as_written_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, "memory_saving_gradients"):
        _assert_as_undecorated(ContextDropout,
                               call=lambda layer, x: layer(x, training=tf.constant(True)))
    assert RUNS_AS_WRITTEN in caplog.text and "tensor" in caplog.text


def test_with_no_tape_the_layer_runs_as_written(traced):
    layer = _decorated(PythonValues)()
    with msg.checkpointing():
        layer(tf.ones([2, 3]))
    assert not traced


def test_tensor_and_python_attributes_set_between_calls_are_read_anew(traced):
    """A tensor attribute crosses as an input of the function (a tape
    watching what made it gets its gradient; a new tensor is no stale
    capture), and Python numbers on the layers key the traces."""
    x = tf.random.stateless_normal([8, 6], seed=[1, 2])
    v = tf.Variable(1.5)
    results = {}
    for name, layer_type in (("stock", AttributeScaled), ("ours", _decorated(AttributeScaled))):
        keras.utils.set_random_seed(0)
        layer, rows = layer_type(), []
        with msg.checkpointing():
            for step, temperature in ((1, 1.0), (2, 2.0), (3, 2.0)):
                with tf.GradientTape() as tape:
                    layer.memory, layer.temperature = v * step, temperature
                    loss = tf.reduce_sum(layer(x) ** 2)
                grads = tape.gradient(loss, [v] + layer.trainable_weights)
                rows.append([loss.numpy()] + [g.numpy() for g in grads])
        results[name] = rows
    for got, want in zip(results["ours"], results["stock"]):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert len(traced) == 2  # one trace per temperature


@pytest.mark.filterwarnings("ignore:.*does not support masking")
@pytest.mark.parametrize("eagerly", [True, False], ids=["eager", "tf.function"])
def test_a_keras_mask_on_an_input_reaches_the_layers_inside(eagerly):
    """Lost before session 67 in both (the segment's stand-ins for its
    inputs carried no mask): the pooling averaged the padding too."""
    def pooled(layer_type):
        keras.utils.set_random_seed(0)
        embedding, layer = keras.layers.Embedding(10, 8, mask_zero=True), layer_type()

        def step(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(embedding(ids)) ** 2)
            return [loss] + tape.gradient(loss, embedding.trainable_weights
                                          + layer.trainable_weights)
        step = step if eagerly else tf.function(step)
        with msg.checkpointing():
            return [tf.convert_to_tensor(t).numpy()
                    for t in step(tf.constant([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0]]))]
    for got, want in zip(pooled(_decorated(MaskReader)), pooled(MaskReader)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layer_type,why", [
    (KeepsScores, "keeps a tensor on a layer (Decorated.scores)"),
    (LossThenUntraceable, "numpy"),
    (ReadsAGlobal, "neither an argument nor an attribute"),
], ids=["stores a tensor", "adds losses then fails", "reads a global tensor"])
def test_a_body_a_function_would_change_runs_as_written_and_says_so(layer_type, why, caplog):
    """The losses added before the trace failed are taken off; the stored
    tensor is the eager one; the global is read anew each call."""
    with caplog.at_level(logging.WARNING, "memory_saving_gradients"):
        _assert_as_undecorated(layer_type)
    assert RUNS_AS_WRITTEN in caplog.text and why in caplog.text


def test_a_python_attribute_new_each_call_ends_in_running_as_written(traced, caplog):
    """Each value is a trace; past eight the layer runs as written, said
    once, with stock's results throughout."""
    x = tf.random.stateless_normal([8, 6], seed=[1, 2])
    losses = {}
    with caplog.at_level(logging.WARNING, "memory_saving_gradients"):
        for name, layer_type in (("stock", AttributeScaled),
                                 ("ours", _decorated(AttributeScaled))):
            keras.utils.set_random_seed(0)
            layer, losses[name] = layer_type(), []
            layer.memory = tf.ones([6])
            with msg.checkpointing():
                for step in range(12):
                    layer.temperature = 1.0 + step
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_sum(layer(x) ** 2)
                    losses[name].append((loss.numpy(), tape.gradient(
                        loss, layer.trainable_weights)[0].numpy()))
    for (got, got_grad), (want, want_grad) in zip(losses["ours"], losses["stock"]):
        np.testing.assert_allclose(got, want, rtol=1e-5)
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert len(traced) == eager_segments._MOST_STATES
    assert caplog.text.count("took more than 8 values") == 1
