"""Every use of a private TensorFlow module, named, in one place.

Each function is a thin alias: when a TensorFlow release moves one of these,
this file is the only one to change.
"""

from tensorflow.python.eager import record as _record
from tensorflow.python.ops import default_gradient as _default_gradient
from tensorflow.python.ops import gradients as _gradients_module
from tensorflow.python.ops import gradients_impl as _gradients_impl


def tf1_optimizer_gradients_module():
    """The module whose `gradients` the TF1 optimizers call.

    `tf.compat.v1.train.Optimizer.compute_gradients` calls
    `tensorflow.python.ops.gradients.gradients`, not `tf.gradients`.
    """
    return _gradients_module


def any_tape_recording() -> bool:
    """True while any GradientTape or ForwardAccumulator could record new ops."""
    return _record.could_possibly_record()


def zeros_gradient(tensor):
    """The zero gradient tf.gradients gives an unconnected `tensor` (a handle: its variable's)."""
    return _default_gradient.zeros_like(tensor)


def stock_gradients(ys, xs, **kwargs):
    """TensorFlow's own tf.gradients, whatever `tf.gradients` is patched to."""
    return _gradients_impl.gradients(ys, xs, **kwargs)
