"""Identical ops, which TensorFlow merges into one before the step runs.

Ops of the same type, inputs, attributes, device and control inputs that have
no side effects become one op, whose output every reader of either then
reads: one buffer, alive until the last of them. Grappler's common-subgraph
elimination does it, and so does the runtime's own graph optimizer (on a
tf.compat.v1 Session graph, four ReLUs of one tensor ran as one with
Grappler's meta optimizer switched off too). Keras models make such twins
where several layers transform one tensor alike: NASNet's cells each apply
their own ReLU, and then their own zero padding, to the same input. Counted
as separate buffers, tf.gradients' activation peak of NASNetMobile (64 px,
batch 8) was predicted at 1.33x what it measured (session 60).
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import op_kinds


def merged_outputs(ops: list, wanted: set) -> dict:
    """Name of each output of `ops` in `wanted` that an earlier op of `ops`
    makes too -> the name of that earlier op's output of the same index.

    `ops` in a topological order (creation order). Twins of twins merge too,
    as Grappler repeats its pass until nothing changes: an op's inputs are
    compared as the tensors they merge into, and constants by value. O(ops).
    """
    first, into, merged = {}, {}, {}
    for op in ops:
        if not op.inputs or not op_kinds.is_recomputable(op):
            continue
        key = _identity(op, into)
        earlier = first.setdefault(key, op)
        if earlier is op:
            continue
        for out, kept in zip(op.outputs, earlier.outputs):
            into[out.name] = kept.name
            if out.name in wanted and kept.name in wanted:
                merged[out.name] = kept.name
    return merged


def _identity(op: tf.Operation, into: dict) -> tuple:
    """What Grappler compares two ops by (commutative inputs in order, as written)."""
    node = op.node_def
    return (op.type, op.device,
            tuple(_input_identity(t, into) for t in op.inputs),
            tuple(sorted(c.name for c in op.control_inputs)),
            tuple(sorted((name, value.SerializeToString(deterministic=True))
                         for name, value in node.attr.items())))


def _input_identity(tensor: tf.Tensor, into: dict):
    if tensor.op.type == "Const" and not tensor.op.control_inputs:
        return ("const", tensor.op.node_def.attr["value"].SerializeToString(deterministic=True),
                tensor.op.device)
    return into.get(tensor.name, tensor.name)
