"""Every use of TensorFlow's private modules (tensorflow.python...) by the TF room.

TensorFlow keeps these APIs stable only in practice; one place to fix them
when a release moves something.
"""

from tensorflow.python.framework import ops as _tf_ops


def create_op_like(graph, op, inputs):
    """A new op in `graph` with `op`'s type and attributes, reading `inputs`."""
    new = graph._create_op_internal(  # pylint: disable=protected-access
        op.type, inputs, dtypes=[o.dtype for o in op.outputs],
        attrs=dict(op.node_def.attr), op_def=op.op_def, compute_device=False)
    for old_t, new_t in zip(op.outputs, new.outputs):
        new_t.set_shape(old_t.shape)
    return new


def registered_gradient(op):
    """The gradient function registered for `op`'s type; None if it has none.

    Raises LookupError when the type was never registered at all.
    """
    return _tf_ops.get_gradient_function(op)

