"""Values of graph tensors that are known before the graph runs.

`tf.get_static_value` folds only a few op types (a Keras RNN's trip count is
`Max` of a constant, which it does not fold). Here a small stateless subgraph
over constants and fully-known shapes is evaluated in a scratch graph.
"""

from typing import Optional

import numpy as np
import tensorflow as tf

from memory_saving_gradients.tfgraph import compat

# Enough for the few ops a loop bound is computed with; larger subgraphs are
# not worth evaluating at graph-build time.
_MAX_OPS = 32


def static_value(tensor: tf.Tensor) -> Optional[np.ndarray]:
    """The value `tensor` always has, or None if it depends on run-time data."""
    value = tf.get_static_value(tensor)
    if value is not None:
        return value
    order = _foldable_ancestors(tensor)
    if order is None:
        return None
    scratch = tf.Graph()
    with scratch.as_default():
        made = {}
        for op in order:
            inputs = [made[t.name] if t.name in made else tf.constant(tf.get_static_value(t))
                      for t in op.inputs]
            new = compat.create_op_copy(scratch, op, inputs)
            made.update((old.name, out) for old, out in zip(op.outputs, new.outputs))
    with tf.compat.v1.Session(graph=scratch) as session:
        return session.run(made[tensor.name])


def const_value(tensor: tf.Tensor) -> Optional[np.ndarray]:
    """The value of `tensor` if a Const op makes it, else None. Read from the op:
    `tf.get_static_value` would make the tensor unfeedable in a Session."""
    return tf.make_ndarray(tensor.op.get_attr("value")) if tensor.op.type == "Const" else None


def _foldable_ancestors(tensor):
    """Ops computing `tensor` from statically known tensors, topologically,
    if all are stateless and call no function; else None."""
    order, seen, stack = [], set(), [(tensor.op, False)]
    while stack:
        op, expanded = stack.pop()
        if expanded:
            order.append(op)
            continue
        if op in seen:
            continue
        seen.add(op)
        op_def = compat.op_def(op.type)
        if (op_def is None or op_def.is_stateful or op.type == "Placeholder"
                or len(seen) > _MAX_OPS
                or any(v.func.name for v in op.node_def.attr.values())):
            return None
        stack.append((op, True))
        stack.extend((t.op, False) for t in op.inputs if tf.get_static_value(t) is None)
    return order
