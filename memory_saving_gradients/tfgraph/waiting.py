"""Making recomputation wait for a gradient through data, not only control.

TF's executor runs an op as soon as its inputs exist, so a recomputed op must
depend on the gradient that reaches it. XLA (jit_compile) drops control
inputs, then runs the copies early or merges them with their originals, so
the dependency must be a data one.
"""

import tensorflow as tf


def addable(dtype: tf.DType) -> bool:
    """True for numeric dtypes (a zero can be added to them)."""
    return dtype.is_floating or dtype.is_integer or dtype.is_complex


def values(gradient):
    """The dense values of a gradient (IndexedSlices or Tensor)."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def after(tensor: tf.Tensor, gradient) -> tf.Tensor:
    """`tensor` plus a zero computed from one element of `gradient`.

    The zero is `0 * (g != g)` cast: never NaN (unlike `0 * g` for an
    infinite g), and XLA folds `x * 0` only for integers, so it stays.
    """
    with tf.name_scope("wait_for_gradient"):
        element = tf.reshape(values(gradient), [-1])[:1]
        unordered = tf.reduce_any(tf.not_equal(element, element))
        return tensor + tf.cast(unordered, tensor.dtype) * tf.zeros([], tensor.dtype)
