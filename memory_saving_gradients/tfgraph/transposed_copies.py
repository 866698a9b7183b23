"""Which recomputed transposed convolutions run scratch-free, and their scratch.

The stock CPU kernel of a transposed convolution (`Conv2DBackpropInput`)
takes 9-20 MiB of scratch on most shapes, however small its tensors, but
little on some (measured, batch 8: 0.1-2 MiB for 3x3 stride-1 ones, 0.5 MiB
for a 4x4 stride-2 one), where `conv_gradients.scratch_free_transposed_copy`
can take more (its flipped filter, twice, and the spread output gradient:
6 MiB for a 3x3 256 -> 256 one). So both are measured, once per shape, and
the rewrite's copies use the scratch-free form only where it takes less.
The planner prices a copy with the same measurement.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import tensorflow as tf

from memory_saving_gradients.tfgraph import allocations
from memory_saving_gradients.tfgraph import conv_gradients
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import workspace

logger = logging.getLogger(__name__)


def recomputes_scratch_free(op: tf.Operation) -> bool:
    """True for an eligible transposed convolution (or one given our gradient:
    the rewrite copies it while `scratch_free_gradients` is open) whose stock
    kernel's measured scratch exceeds our form's. With an unknown batch size
    neither is measured: then where taps do not overlap (one `MatMul`: the
    stock FLOPs, an output-sized product as scratch)."""
    if op.type != "Conv2DBackpropInput":
        return False  # reading asks every op: no NodeDef parsed for the others
    override = op.node_def.attr.get("_gradient_op_type")
    if not (workspace.scratch_free_saves(op) or (
            override is not None
            and override.s.decode() == conv_gradients.SCRATCH_FREE_GRADIENT)):
        return False
    if not _shapes_known(op):
        return conv_gradients.taps_apart(op)
    scratch = copy_workspace_bytes(op)
    return scratch is not None and scratch < workspace.run_workspace_bytes(op)


def copy_workspace_bytes(op: tf.Operation) -> int | None:
    """Bytes `scratch_free_transposed_copy` of transposed convolution `op`
    allocates besides its output: measured; with an unknown batch size, its
    output's bytes (the product of the tiled form); None if it fails to run."""
    output = op.outputs[0]
    if not _shapes_known(op):
        return op_kinds.tensor_bytes(output)
    shapes = tuple(tuple(t.shape.as_list()) for t in (op.inputs[2], op.inputs[1], output))
    return _measured(shapes, tuple(op.get_attr("strides")), op.get_attr("padding"),
                     output.dtype.name)


def _shapes_known(op):
    """Both the output and `out_backprop` fully defined: the one may be set by
    the user (set_shape) while the other's batch is unknown."""
    return op.outputs[0].shape.is_fully_defined() and op.inputs[2].shape.is_fully_defined()


@functools.lru_cache(maxsize=None)
def _measured(shapes, strides, padding, dtype):
    """Runs our form on zeros in a scratch graph (twice: the first run may set
    up caches); the second run's peak of bytes requested above its output is
    its scratch."""
    out_backprop_shape, filter_shape, output_shape = shapes
    with allocations.probe_graph("CPU:0") as (graph, scope):
        out_backprop = tf.compat.v1.placeholder(dtype, out_backprop_shape)
        w = tf.compat.v1.placeholder(dtype, filter_shape)
        stand_in = tf.nn.conv2d_transpose(out_backprop, w, output_shape, list(strides),
                                          padding.decode())
        copy = conv_gradients.scratch_free_transposed_copy(stand_in.op,
                                                           list(stand_in.op.inputs))
    feed = {out_backprop: np.zeros(out_backprop_shape, dtype),
            w: np.zeros(filter_shape, dtype)}
    output_bytes = int(np.prod(output_shape)) * tf.as_dtype(dtype).size
    try:
        with tf.compat.v1.Session(graph=graph) as session:
            peak = allocations.requested_run_peak(session, copy.op, feed, scope)
    except Exception as error:  # pylint: disable=broad-except  # then the copy stays stock
        logger.debug("scratch-free transposed copy failed to run: %s", error)
        return None
    return max(peak - output_bytes, 0)
