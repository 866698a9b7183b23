"""Second orders through max pools without TensorFlow's CPU `MaxPoolGradGrad`.

The registered gradient of `MaxPoolGrad` (and `MaxPoolGradV2`) is
`MaxPoolGradGrad`, whose CPU kernel may take its `grad` input's buffer as its
output (`forward_input_or_allocate_output`) and then read what it has already
written: the result is all zeros. It can forward only when the output has
that input's shape, i.e. when the pool's output has its input's shape
(stride 1 SAME, any window; a 1x1 VALID window; a SAME pool of a 1x1 image),
and only when nothing else still reads the buffer, so whether a second order
comes out zero depends on the executor's schedule: measured on TF 2.16 and
2.21, a plain second-order `tf.gradients` graph through
`tf.nn.max_pool2d(x, 2, 1, "SAME")` was all zeros 10 runs in 10, in a
tf.function and in a Session, while eager nested tapes (which hold the
buffer) were right; stride 2, or stride 1 VALID with a 2x2 window, were
right (tests/test_max_pool_grad_grad.py).

`argmax_gradients(ops)` makes tf.gradients differentiate the affected ones
among `ops` (and copies of them made meanwhile: a copy takes its original's
attributes) another way: the incoming gradient gathered at the indices of
`tf.nn.max_pool_with_argmax` of the pool's input. That is MaxPoolGradGrad's
value, the adjoint of MaxPoolGrad's routing: on CPU both MaxPoolGrad and
MaxPoolWithArgmax take the first maximum of a window in row-major order.
Only on CPU-only hosts and outside XLA (XLA compiles MaxPoolGradGrad itself
and has no MaxPoolWithArgmax kernel); NHWC only (the CPU kernels' only
layout). `MaxPool3DGrad`'s `MaxPool3DGradGrad` has the same fault and is
not covered: TensorFlow has no 3-D argmax pool.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import op_kinds

ARGMAX_GRADIENT = "MemorySavingGradientsArgmaxMaxPoolGradGrad"
_KINDS = frozenset({"MaxPoolGrad", "MaxPoolGradV2"})


def is_affected(op: tf.Operation) -> bool:
    """True for a CPU `MaxPoolGrad`/`MaxPoolGradV2` whose stock gradient's
    kernel may zero its result: NHWC, SAME or VALID, a window over height and
    width only (static for V2), and a pool whose output may have its input's
    shape (equal, or not known statically); without a gradient override of its own."""
    if op.type not in _KINDS or not op_kinds.gradient_overridable_on_cpu(op):
        return False
    if op.get_attr("data_format") != b"NHWC" or op.get_attr("padding") not in (b"SAME", b"VALID"):
        return False
    window = _window(op)
    if window is None or any(len(w) != 4 or w[0] != 1 or w[3] != 1 for w in window):
        return False
    image, pooled = op.inputs[0].shape, op.inputs[1].shape
    return not (image.is_fully_defined() and pooled.is_fully_defined() and image != pooled)


@contextlib.contextmanager
def argmax_gradients(ops: Iterable[tf.Operation]) -> Iterator[None]:
    """Within, tf.gradients differentiates the affected max-pool gradients among
    `ops` (and copies of them made meanwhile) by `_argmax_gradient`."""
    with compat.gradients_overridden([op for op in ops if is_affected(op)], ARGMAX_GRADIENT):
        yield


def _window(op: tf.Operation):
    """(ksize, strides) of a MaxPoolGrad(V2) as lists, or None where V2's are not static."""
    if op.type == "MaxPoolGrad":
        return list(op.get_attr("ksize")), list(op.get_attr("strides"))
    values = [tf.get_static_value(t) for t in op.inputs[3:5]]
    return None if any(v is None for v in values) else tuple([int(n) for n in v] for v in values)


@tf.RegisterGradient(ARGMAX_GRADIENT)
def _argmax_gradient(op, grad):
    """d MaxPoolGrad / d its `grad` input: `grad` here read at each window's
    maximum; zero for the pool's input and output, as in TensorFlow's own."""
    image, pooled = op.inputs[0], op.inputs[1]
    ksize, strides = _window(op)
    _, argmax = tf.nn.max_pool_with_argmax(image, ksize, strides, op.get_attr("padding"),
                                           include_batch_in_index=True)
    picked = tf.gather(tf.reshape(grad, [-1]), argmax)
    results = (tf.zeros_like(image), tf.zeros_like(pooled), picked)
    return results + (None, None) if op.type == "MaxPoolGradV2" else results
