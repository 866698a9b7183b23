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
phases differentiated by stock tf.gradients keep them early.
"""

from __future__ import annotations

from memory_saving_gradients.tfgraph import op_kinds

# Ops that read only a tensor's shape or make constants: nothing held.
_FREE_OP_TYPES = frozenset({"Const", "Shape", "ShapeN", "Size", "Rank", "Placeholder"})


def early_bytes(ops: list, seeds: list) -> int:
    """Bytes of the outputs of `ops` (one gradient's ops, creation order) that
    depend on none of `seeds` and are read by an op that does: made in the
    forward pass, held until backprop."""
    seed_ops = {t.op for t in seeds if t is not None}
    waits = set()  # ops that depend on a seed
    for op in ops:
        if (op in seed_ops or any(t.op in waits or t.op in seed_ops for t in op.inputs)
                or any(c in waits or c in seed_ops for c in op.control_inputs)):
            waits.add(op)
    among = set(ops)
    held = {t.ref(): t for op in waits for t in op.inputs
            if t.op in among and t.op not in waits and t.op.type not in _FREE_OP_TYPES}
    return sum(op_kinds.tensor_bytes(t) for t in held.values()
               if t.dtype.base_dtype not in op_kinds.OPAQUE_DTYPES)
