"""Models shared by the test files: seeded data, dense stacks, chains and RNN stacks.

Model-building functions take a `harness.Context` (variables made once) and
return what `harness.gradients_vs_stock` needs.
"""

import numpy as np
import tensorflow as tf

from harness import Model


def rng(seed=0):
    return np.random.RandomState(seed)


def normal(shape, scale=1.0, seed=0, dtype=np.float32):
    """Seeded Gaussian data of `shape`."""
    return (rng(seed).randn(*shape) * scale).astype(dtype)


def dense_layers(ctx, sizes, prefix="w", scale=0.5):
    """Weight matrices for a dense stack of layer `sizes`."""
    return [ctx.variable(f"{prefix}{i}", normal((a, b), scale / np.sqrt(a), seed=i + 1))
            for i, (a, b) in enumerate(zip(sizes, sizes[1:]))]


def tanh_block(h):
    return tf.tanh(h)


def residual_block(h):
    return h + tf.tanh(h)


def rnn_stack(ctx, x, layers=3, in_body=None):
    """`layers` tanh RNNs, each a tf.while_loop over the time steps of its
    input that reads its weights inside the body and writes a TensorArray, as
    Keras' LSTM does; `in_body(h)` runs in every body too."""
    hs = x
    for layer in range(layers):
        w = ctx.variable(f"w{layer}", normal((hs.shape[-1], 6), 0.5, seed=2 * layer))
        u = ctx.variable(f"u{layer}", normal((6, 6), 0.4, seed=2 * layer + 1))

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
