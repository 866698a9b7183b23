"""Max-pooling gradients under XLA without XLA's index buffers.

XLA compiles TensorFlow's `MaxPoolGrad` to a select-and-scatter, which its
CPU backend expands into a reduce-window over the pool's input and one `s32`
iota per dimension of that input (four arrays of the input's shape, twice its
bytes each for float32). The iotas have no operands, and XLA's scheduler puts
them at the start of the step. Under tf.gradients that costs little: the
select-and-scatter's argmax reads only forward tensors, so XLA runs it in the
forward pass and the iotas die there. When the rewrite recomputes a pool's
input, its gradient can only run in backprop, and the iotas stay alive from
the first instruction to there: in the classic U-Net's `"memory"` step, 14 of
the 39 MB alive at XLA's peak, all checkpoints and recomputation aside.

For a pool whose windows tile its input (window = stride, no padding) the
gradient is exact without any index buffer: scanning each window's taps in
row-major order, the candidate moves to a tap unless the candidate is
greater than or equal to it (XLA's own select rule, NaN included), and the
output gradient goes to the last candidate. The taps are compared with each
other, never with the pooled output: XLA may compute a fused producer of the
input twice and round the two differently, so an element bitwise equal to
the pooled maximum is not guaranteed to exist. Only under XLA: TensorFlow's
own CPU and GPU kernels build no such buffers.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat

FIRST_MAX_GRADIENT = "MemorySavingGradientsFirstMaxPool"


def is_eligible(op: tf.Operation) -> bool:
    """True for an XLA-compiled NHWC `MaxPool` whose windows tile its input
    (window = stride, VALID, or SAME with sizes the stride divides), static
    spatial and channel sizes, without a gradient override of its own."""
    if op.type != "MaxPool" or "_gradient_op_type" in op.node_def.attr:
        return False
    if not compat.in_xla_context(op.graph) or op.get_attr("data_format") != b"NHWC":
        return False
    ksize, strides = list(op.get_attr("ksize")), list(op.get_attr("strides"))
    image = op.inputs[0]
    if ksize != strides or ksize[0] != 1 or ksize[3] != 1:
        return False
    if not image.shape[1:].is_fully_defined():
        return False
    if op.get_attr("padding") == b"SAME":
        return all(size % k == 0 for size, k in zip(image.shape[1:3], ksize[1:3]))
    return op.get_attr("padding") == b"VALID"


@contextlib.contextmanager
def first_max_gradients(ops: Iterable[tf.Operation]) -> Iterator[None]:
    """Within, tf.gradients differentiates the eligible max pools among `ops`
    (and copies of them made meanwhile: a copy takes its original's
    attributes) by `_first_max_gradient`."""
    with compat.gradients_overridden([op for op in ops if is_eligible(op)],
                                     FIRST_MAX_GRADIENT):
        yield


@tf.RegisterGradient(FIRST_MAX_GRADIENT)
def _first_max_gradient(op, grad):
    """d image: `grad` at the tap of each window that XLA's select-and-scatter
    picks, zero elsewhere."""
    image = op.inputs[0]
    _, kh, kw, _ = op.get_attr("ksize")
    _, height, width, channels = image.shape.as_list()
    out_h, out_w = height // kh, width // kw  # SAME here only where they divide
    covered = image[:, :out_h * kh, :out_w * kw, :]
    windows = tf.reshape(covered, [-1, out_h, kh, out_w, kw, channels])
    taps = [windows[:, :, a, :, b, :] for a in range(kh) for b in range(kw)]
    best, chosen = taps[0], tf.zeros_like(grad, tf.int32)
    for index, tap in enumerate(taps[1:], start=1):
        moves = tf.logical_not(tf.greater_equal(best, tap))
        best = tf.where(moves, tap, best)
        chosen = tf.where(moves, index, chosen)
    zeros = tf.zeros_like(grad)
    spread_taps = [tf.where(tf.equal(chosen, index), grad, zeros) for index in range(len(taps))]
    rows = [tf.stack(spread_taps[a * kw:(a + 1) * kw], axis=3) for a in range(kh)]
    spread = tf.reshape(tf.stack(rows, axis=2), [-1, out_h * kh, out_w * kw, channels])
    missing = [height - out_h * kh, width - out_w * kw]  # VALID: rows no window reads
    if any(missing):
        spread = tf.pad(spread, [[0, 0], [0, missing[0]], [0, missing[1]], [0, 0]])
    return spread
