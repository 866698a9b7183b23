"""Small Keras models shared by the layer-decorator and accumulation tests.

`Block` and `RecomputedBlock` are the same layer, the second with its call
decorated by @recompute_grad; models built by `build_model` from the same seed
have the same weights and draw the same dropout masks.
"""

import contextlib

import keras
import numpy as np

import memory_saving_gradients as msg
from memory_saving_gradients.keras import recompute_grad

WIDTH = 16


class Block(keras.layers.Layer):
    """Dense -> dropout -> batch norm -> dense, residual: variables, training=, state."""

    def __init__(self, units=WIDTH, dropout=0.3, batch_norm=True, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(units, activation="relu")
        self.dropout = keras.layers.Dropout(dropout, seed=1) if dropout else None
        self.norm = keras.layers.BatchNormalization() if batch_norm else None
        self.outer = keras.layers.Dense(units)

    def call(self, x, training=None):
        h = self.inner(x)
        if self.dropout is not None:
            h = self.dropout(h, training=training)
        if self.norm is not None:
            h = self.norm(h, training=training)
        return x + self.outer(h)


class RecomputedBlock(Block):
    @recompute_grad
    def call(self, x, training=None):
        return super().call(x, training=training)


def build_model(block, num_blocks=3, optimizer=None, jit_compile=False, **block_kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = inputs
    for i in range(num_blocks):
        h = block(name=f"block{i}", **block_kwargs)(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01), loss="mse",
                  jit_compile=jit_compile)
    return model


def data(batch=32):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(batch, WIDTH)).astype("float32"),
            rng.normal(size=(batch, 1)).astype("float32"))


def switched(on):
    """Checkpointing in force (decorated layers recompute) if `on`, else nothing.

    Keras traces its train function on the first `fit` step: enter this
    around the `fit` call.
    """
    return msg.checkpointing() if on else contextlib.nullcontext()


def assert_same_weights(got, want, rtol=0.0, atol=0.0):
    """Equal within tolerance, and finite (NaNs would compare equal)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.isfinite(w).all(), "the reference diverged: lower the learning rate"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
