"""The parts of a gradient that TensorFlow runs in the forward pass.

TensorFlow's executor runs an op as soon as its inputs exist. A gradient op
that reads only forward tensors (no output gradient, directly or through
other gradient ops, by data or control edges) therefore runs when the
forward pass has made them, and its result stays alive until the gradient
ops that read it run in backprop. `tf.nn.silu`'s gradient computes
`beta * features` so (outside its wait for `dy`): one tensor per swish held
from the forward pass to backprop under stock tf.gradients (measured:
EfficientNetB0's stock peak, 11 MB of its 85 with one inter-op thread).
Our levels make such ops wait for the gradient (captured_reads.py); the
phases differentiated by stock tf.gradients keep them early. Grappler can make
such an op after this reading, by rotating a constant onto a forward tensor
(`(g * x) / 6` into `g * (x * (1 / 6))`); constant_push_down.py pins those.
"""

from __future__ import annotations

import numpy as np

from memory_saving_gradients.tfgraph import op_kinds

# Ops that read only a tensor's shape or make constants: nothing held.
_FREE_OP_TYPES = op_kinds.SHAPE_ONLY_OP_TYPES | {"Const", "Placeholder"}


def seed_free(ops: list, seed_ops) -> set:
    """The ops of `ops` (creation order) that depend on none of `seed_ops`,
    directly or through other ops of `ops`, by data or control edges: they
    run as soon as the forward tensors they read exist."""
    waiting, free = set(seed_ops), set()
    for op in ops:
        if (op in waiting or any(t.op in waiting for t in op.inputs)
                or any(c in waiting for c in op.control_inputs)):
            waiting.add(op)
        else:
            free.add(op)
    return free


def early_bytes(ops: list, seeds: list, value_of=lambda t: None) -> int:
    """Bytes of the outputs of `ops` (one gradient's ops, creation order) that
    depend on none of `seeds` and are read by an op that does: made in the
    forward pass, held until backprop. `value_of(t)`: `t`'s value where
    Grappler folds it before the graph runs, else None."""
    free = seed_free(ops, {t.op for t in seeds if t is not None})
    held = {t.ref(): t for op in ops if op not in free for t in op.inputs
            if t.op in free and t.op.type not in _FREE_OP_TYPES}
    return sum(op_kinds.tensor_bytes(t) for t in held.values()
               if t.dtype.base_dtype not in op_kinds.OPAQUE_DTYPES
               and folds_to_identity(t, value_of) is None)


def folds_to_identity(t, value_of):
    """The `x` of `t = x * 1` where `t` has x's shape, else None: Grappler's
    constant folding makes such a product an Identity of x, which holds no
    buffer of its own (`tf.nn.silu`'s gradient computes `beta * features`
    early; with the default beta of 1 nothing is made in a tf.function:
    EfficientNetB0's stock peak was predicted 1.26x measured with it counted,
    1.00 without). A single 1 keeps x's shape whatever x's unknown dimensions
    are, and Grappler folds it so too (with the batch unknown, EfficientNetB0
    at 96 px measured the same stock peak as with it known; counted, its
    prediction was 630 MiB against 495). `value_of` as in `early_bytes`."""
    if t.op.type != "Mul" or t.shape.rank is None:
        return None
    for one, x in (t.op.inputs, reversed(t.op.inputs)):
        value = value_of(one)
        if value is None or not np.all(value == 1) or x.shape.rank != t.shape.rank:
            continue
        if (np.size(value) == 1 and np.ndim(value) <= x.shape.rank
                or t.shape.is_fully_defined() and x.shape == t.shape):
            return x
    return None
