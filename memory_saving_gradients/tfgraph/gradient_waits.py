"""Making recomputation wait for a gradient, through data as well as control.

TF's executor runs an op as soon as its inputs exist, so a recomputed op must
depend on the gradient that reaches it; XLA (jit_compile) drops control
inputs, so the dependency must be a data one. Used by copying.py and
loop_chunks.py.
"""

from __future__ import annotations

import tensorflow as tf


def gradient_values(gradient):
    """The dense values of a gradient (Tensor or IndexedSlices)."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def is_numeric(dtype: tf.DType) -> bool:
    return dtype.is_floating or dtype.is_integer or dtype.is_complex


def wait_for_gradient(tensor: tf.Tensor, gradient) -> tf.Tensor:
    """`tensor` plus a zero computed from one element of `gradient`.

    A data dependency that XLA must respect (it drops control inputs). The
    zero is `0 * (g != g)` cast: never NaN (unlike `0 * g` for an infinite g),
    and XLA folds `x * 0` only for integers, so it stays.
    """
    with tf.name_scope("wait_for_gradient"):
        element = tf.reshape(gradient_values(gradient), [-1])[:1]
        unordered = tf.reduce_any(tf.not_equal(element, element))
        return tensor + tf.cast(unordered, tensor.dtype) * tf.zeros([], tensor.dtype)
