"""tf_keras (Keras 2, TF_USE_LEGACY_KERAS=1): fit with Checkpointing equals stock fit.

tf_keras replaces tf.keras only in a process that sets the variable before
importing TensorFlow, so the check runs in a subprocess (bounded in time).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

# Looked up, not imported: importing tf_keras into the test process changes what
# `tf.gradients` resolves to for every later test.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                                reason="tf_keras is not installed")

SCRIPT = r"""
import logging
import numpy as np
import tensorflow as tf
import tf_keras
import memory_saving_gradients as msg
import memory_saving_gradients.keras as msg_keras

assert tf.keras is tf_keras or tf.keras.__name__.startswith("tf_keras"), tf.keras
records = []
logging.getLogger("memory_saving_gradients").addHandler(
    type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r.getMessage())})())
logging.getLogger("memory_saving_gradients").setLevel(logging.INFO)
rng = np.random.RandomState(0)
x, y = rng.randn(32, 16).astype("float32"), rng.randint(0, 4, 32)

def fit(callbacks):
    tf_keras.utils.set_random_seed(3)
    inputs = tf_keras.Input((16,))
    h = inputs
    for _ in range(4):
        h = tf_keras.layers.Dense(32, activation="relu")(h)
        h = tf_keras.layers.BatchNormalization()(h)
        h = tf_keras.layers.Dropout(0.2)(h)
    model = tf_keras.Model(inputs, tf_keras.layers.Dense(4)(h))
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), steps_per_execution=2,
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tf_keras.utils.set_random_seed(4)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    return [v.numpy() for v in model.weights]

stock = fit([])
ours = fit([msg_keras.Checkpointing("memory")])
assert any("recompute" in r for r in records), records
assert not any("left to TensorFlow" in r for r in records), records
for a, b in zip(stock, ours):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)

def own_loop(optimizer, checkpointing):
    # A user's GradientTape step returning nothing, traced while checkpointing.
    tf_keras.utils.set_random_seed(3)
    model = tf_keras.Sequential([tf_keras.layers.Dense(32, activation="tanh"),
                                 tf_keras.layers.Dense(4)])
    model.build((None, 16))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - 0.5) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(grads_and_vars=zip(grads, model.trainable_variables))
    for _ in range(3):
        if checkpointing:
            with msg.checkpointing("memory"):
                step(x)
        else:
            step(x)
    return [v.numpy() for v in model.weights]

logging.getLogger("memory_saving_gradients").setLevel(logging.DEBUG)
# The legacy SGD's momentum is one fused op that reads the gradient: nothing waits.
for make, waits in ((lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9), True),
                    (lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9), False)):
    del records[:]
    ours = own_loop(make(), True)
    waiting = [int(r.split()[1]) for r in records if "update wait" in r]
    assert waiting and (waiting[-1] > 0) == waits, records
    for a, b in zip(own_loop(make(), False), ours):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
print("TF_KERAS_OK")
"""


@pytest.mark.slow  # a fresh TensorFlow + tf_keras process: 1-2.5 minutes on 2 shared cores
def test_tf_keras_fit_with_callback_equals_stock():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                            text=True, timeout=300, check=False)
    assert "TF_KERAS_OK" in result.stdout, result.stderr[-3000:]


DECORATOR_SCRIPT = r"""
import numpy as np
import tensorflow as tf
import tf_keras
import memory_saving_gradients.keras as msg_keras
from memory_saving_gradients.integrations import layer_decorator
from memory_saving_gradients.keras import recompute_grad

segments = []
build_segment = layer_decorator._call_as_segment
layer_decorator._call_as_segment = lambda *a: segments.append(1) or build_segment(*a)


class Block(tf_keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = tf_keras.layers.Dense(16, activation="tanh")
        self.dropout = tf_keras.layers.Dropout(0.2)

    def call(self, x, training=None):
        return x + self.dropout(self.dense(x), training=training)


class RecomputedBlock(Block):
    @recompute_grad
    def call(self, x, training=None):
        return super().call(x, training=training)


class Squash(tf_keras.layers.Layer):  # a call taking no `training`
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = tf_keras.layers.Dense(16)

    def call(self, x):
        return tf.tanh(self.dense(x)) * x


class RecomputedSquash(Squash):
    @recompute_grad
    def call(self, x):
        return super().call(x)


rng = np.random.RandomState(0)
x, y = rng.randn(32, 16).astype("float32"), rng.randint(0, 4, 32)

def fit(block, squash, callbacks):
    tf_keras.utils.set_random_seed(3)
    inputs = tf_keras.Input((16,))
    h = inputs
    for _ in range(3):
        h = squash()(block()(h))
    model = tf_keras.Model(inputs, tf_keras.layers.Dense(4)(h))
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tf_keras.utils.set_random_seed(4)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    return [v.numpy() for v in model.weights]

stock = fit(Block, Squash, [])
off = fit(RecomputedBlock, RecomputedSquash, [])
assert not segments, segments
on = fit(RecomputedBlock, RecomputedSquash, [msg_keras.Checkpointing("memory")])
assert segments
for ours in (off, on):
    for a, b in zip(stock, ours):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
print("TF_KERAS_DECORATOR_OK")
"""


@pytest.mark.slow  # a fresh TensorFlow + tf_keras process
def test_tf_keras_decorated_layer_equals_stock():
    # Found by a review: the decorator took only Keras 3's Layer (TypeError even
    # with the switch off), and tf_keras, reading the wrapper's (*args, **kwargs),
    # passed `training=` to calls that take none.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", DECORATOR_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert "TF_KERAS_DECORATOR_OK" in result.stdout, result.stderr[-3000:]
