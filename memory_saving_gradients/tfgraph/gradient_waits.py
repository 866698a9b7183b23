"""Making recomputation wait for a gradient, through data as well as control.

TF's executor runs an op as soon as its inputs exist, so a recomputed op must
depend on the gradient that reaches it; XLA (jit_compile) drops control
inputs, so the dependency must be a data one. Used by copying.py, rewrite.py, the loop
reruns and the layer decorator.
"""

from __future__ import annotations

import tensorflow as tf


def gradient_values(gradient):
    """The dense values of a gradient (Tensor or IndexedSlices)."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def gradient_tensors(gradient) -> list:
    """The tensors of a gradient: itself, or an IndexedSlices' parts."""
    if isinstance(gradient, tf.IndexedSlices):
        return [t for t in (gradient.values, gradient.indices, gradient.dense_shape)
                if t is not None]
    return [gradient]


def ancestors_among(ops, tensors) -> set:
    """The ops of `ops` that `tensors` depend on (data or control), by a walk
    back from their ops that stops outside `ops`."""
    among = set(ops)
    todo = [t.op for t in tensors]
    found = set()
    while todo:
        op = todo.pop()
        if op in found or op not in among:
            continue
        found.add(op)
        todo.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return found


def depends_on(later: tf.Operation, first: tf.Operation) -> bool:
    """True when a data or control path runs from `first` to `later` (a walk
    over the whole graph)."""
    seen, todo = set(), [later]
    while todo:
        op = todo.pop()
        if op is first:
            return True
        if op not in seen:
            seen.add(op)
            todo.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return False


def is_numeric(dtype: tf.DType) -> bool:
    return dtype.is_floating or dtype.is_integer or dtype.is_complex


def gate(gradients: list):
    """A scalar that exists only once all `gradients` do; None if none is numeric.

    A level's recomputation waits for it: for the gradients reaching the
    level, and for every gradient the previous phase returned, so that
    phase's gradient ops, weight gradients (Conv2DBackpropFilter, ...)
    included, have run and its recomputed tensors are free. Without it,
    TensorFlow with one inter-op thread defers weight gradients to the end of
    the step and every level's copies stay alive together. It reads one
    element of each gradient: `g != g` is never NaN (unlike `0 * g` for an
    infinite g).
    """
    values = [gradient_values(g) for g in gradients if is_numeric(gradient_values(g).dtype)]
    if not values:
        return None
    with tf.name_scope("wait_for_gradients"):
        # Raw ops on constants shared by all gradients: a gate per level on a
        # deep model otherwise spends most of the rewrite's time in slicing.
        flat, zero, one = (tf.constant([v], tf.int32) for v in (-1, 0, 1))
        elements = []
        for v in values:
            first = tf.raw_ops.StridedSlice(input=tf.raw_ops.Reshape(tensor=v, shape=flat),
                                            begin=zero, end=one, strides=one)
            elements.append(tf.raw_ops.NotEqual(x=first, y=first))
        return tf.reduce_any(tf.concat(elements, axis=0))


def wait_for_gate(tensor: tf.Tensor, level_gate: tf.Tensor) -> tf.Tensor:
    """`tensor` plus a zero computed from `level_gate` (see `gate`).

    A data dependency that XLA must respect (it drops control inputs); XLA
    folds `x * 0` only for integers, so it stays.
    """
    with tf.name_scope("wait_for_gradient"):
        return tensor + tf.cast(level_gate, tensor.dtype) * tf.zeros([], tensor.dtype)


def seed_after_gate(seed, level_gate):
    """`seed` (a dense gradient a level starts from), readable only once
    `level_gate` exists.

    Copies wait for the gate, but a gradient op reading only the seed (a
    mean's gradient tiles it to full size) does not: its level's backprop
    began as soon as the seed existed, beside the level above (MobileNetV2 at
    batch 144: a batch norm's mean and variance, each in a level of its own,
    tiled their gradients while the level above held its largest buffers).
    A control edge through an Identity, which takes no buffer of its own.
    """
    if level_gate is None or not isinstance(seed, tf.Tensor):
        return seed
    with tf.control_dependencies([level_gate]):
        return tf.identity(seed)


def wait_for_gradient(tensor: tf.Tensor, gradient) -> tf.Tensor:
    """`tensor` plus a zero computed from one element of numeric `gradient`."""
    return wait_for_gate(tensor, gate([gradient]))
