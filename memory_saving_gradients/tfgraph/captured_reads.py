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
original is freed after the forward pass as the plan expects. A kept tensor
the level reads is pointed at the level's stub of it.

A gradient op that depends on no output gradient (it reads forward tensors,
or constants the call made; early_gradients.py) runs as soon as they exist
and holds its result until backprop reaches it: `tf.nn.silu`'s gradient computes `beta * features`
outside its control dependency on `dy`, which ran in the forward pass and
held one tensor per kept swish input (measured on a chain of `tf.nn.silu`:
18 MB for 14 predicted). `wait_for_seeds` makes such ops wait for the
gradient reaching the level. An op that reads only a shape (`tf.shape(x)`,
which a mean's gradient reads when the batch is unknown) is left to run at
once and its readers wait: made to wait, it kept x alive until the gradient
came (MobileNetV2 under `fit` on a dataset, one inter-op thread: each batch
norm's recomputed squared differences held through its level's recomputation).
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat, early_gradients, op_kinds
from memory_saving_gradients.tfgraph.gradient_waits import gradient_tensors


def read_copies(new_ops: list, copies: dict) -> int:
    """Points inputs of `new_ops` (gradient ops of one level) that are original
    tensors the level copies or reads at what the level reads for them
    (`copies`: original name -> copy or stub). Returns how many inputs it
    moved. Linear in the new ops' inputs."""
    moved = 0
    for op in new_ops:
        for index, tensor in enumerate(op.inputs):
            twin = copies.get(tensor.name)
            if twin is not None and twin is not tensor and _same_kind(tensor, twin):
                compat.replace_input(op, index, twin)
                moved += 1
    return moved


def wait_for_seeds(new_ops: list, seeds: list) -> int:
    """Makes the ops of `new_ops` that would run before `seeds` exist and read
    a forward tensor (besides, perhaps, constants the call made) wait for
    `seeds`: the first such op on each path; the ops after it wait through it.
    An op reading only shapes (`op_kinds.SHAPE_ONLY_OP_TYPES`) stays free and
    its readers wait. Ops of constants alone are left to constant folding.
    Returns how many ops were given waits."""
    seed_ops = [t.op for g in seeds if g is not None for t in gradient_tensors(g)]
    free = early_gradients.seed_free(new_ops, seed_ops)
    made, waiting, shapes, given = set(new_ops), set(), set(), 0
    for op in new_ops:
        if op not in free:
            continue
        if any(t.op in waiting for t in op.inputs) or waiting.intersection(op.control_inputs):
            waiting.add(op)
        elif (any(t.op not in made or t.op in shapes for t in op.inputs)
              or shapes.intersection(op.control_inputs)):
            if op.type in op_kinds.SHAPE_ONLY_OP_TYPES:
                # Left free, so that it does not keep the tensor it measures alive
                # until the seed: its readers wait instead.
                shapes.add(op)
                continue
            for seed in seed_ops:
                compat.add_control_input(op, seed)
            waiting.add(op)
            given += 1
    return given


def _same_kind(original: tf.Tensor, twin: tf.Tensor) -> bool:
    return original.dtype == twin.dtype and original.shape.is_compatible_with(twin.shape)
