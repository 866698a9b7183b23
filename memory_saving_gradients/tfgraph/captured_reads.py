"""Gradient ops of a level read the level's copies, never the originals they copy.

A registered gradient finds the forward tensors it needs through the op it is
given, so differentiating a copy reads the copy's inputs and outputs. A
`tf.custom_gradient` does not: its gradient is a Python closure over the
tensors of the call that made it, and ignores the op (`tf.nn.silu`, Keras'
swish, recomputes its sigmoid from the features it closed over). Built for a
recomputed copy, it reads the *original* forward tensor, which then stays
alive from the forward pass until backprop reaches the level: EfficientNetB0's
`"memory"` plan kept the input of every swish that way (measured: the stem's
and each block's batch-norm output alive at the start of backprop).

A copy holds the same value as its original (only recomputable ops are
copied), so such a read is pointed at the copy: the same gradient, and the
original is freed after the forward pass as the plan expects.
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat


def read_copies(new_ops: list, copies: dict) -> int:
    """Points inputs of `new_ops` (gradient ops of one level) that are original
    tensors copied in the level at their copies (`copies`: original name ->
    copy). Returns how many inputs it moved. Linear in the new ops' inputs."""
    moved = 0
    for op in new_ops:
        for index, tensor in enumerate(op.inputs):
            twin = copies.get(tensor.name)
            if twin is not None and twin is not tensor and _same_kind(tensor, twin):
                compat.replace_input(op, index, twin)
                moved += 1
    return moved


def _same_kind(original: tf.Tensor, twin: tf.Tensor) -> bool:
    return original.dtype == twin.dtype and original.shape.is_compatible_with(twin.shape)
