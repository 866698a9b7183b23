"""Monkey-patching: route every tf.gradients call in the process to a mode.

The classic one-liner still works::

    tf.__dict__["gradients"] = memory_saving_gradients.gradients_memory

These helpers do the same for tf.gradients, tf.compat.v1.gradients and the
function the TF1 optimizers call (`Optimizer.compute_gradients`), route
`tf.GradientTape.gradient` inside tf.function through the same mode (see
integrations/tape.py), and put the originals back.
"""

import contextlib
import functools
import inspect

import tensorflow as tf

from memory_saving_gradients import api
from memory_saving_gradients.integrations import tape
from memory_saving_gradients.tfgraph import compat

_TARGETS = ((tf, "gradients"), (tf.compat.v1, "gradients"),
            (compat.tf1_optimizer_gradients_module(), "gradients"))
_saved = []  # stack of (checkpoints, the functions it replaced), for nesting


def patch_tf_gradients(checkpoints="memory") -> None:
    """Makes tf.gradients, tf.compat.v1.gradients, the TF1 optimizers and
    GradientTape.gradient inside tf.function checkpoint with `checkpoints`.

    `checkpoints` is any value `gradients` accepts ('memory', 'speed',
    'collection' or a list of tensors). Undo with `unpatch_tf_gradients()`.
    """
    api.validate_checkpoints(checkpoints)
    tape.install(active_checkpoints)
    originals = [getattr(module, name) for module, name in _TARGETS]
    _saved.append((checkpoints, originals))
    for (module, name), original in zip(_TARGETS, originals):
        setattr(module, name, _replacement(original, checkpoints))


def _replacement(original, checkpoints):
    """api.gradients taking `original`'s arguments, positional ones included
    (tf.gradients and tf.compat.v1.gradients differ after `name`)."""
    signature = inspect.signature(original)

    @tf.autograph.experimental.do_not_convert
    @functools.wraps(original)
    def gradients(*args, **kwargs):
        return api.gradients(**signature.bind(*args, **kwargs).arguments,
                             checkpoints=checkpoints)
    return gradients


def unpatch_tf_gradients() -> None:
    """Restores the functions the most recent `patch_tf_gradients` replaced."""
    if not _saved:
        raise RuntimeError("tf.gradients is not patched by memory_saving_gradients; "
                           "call patch_tf_gradients() first")
    for (module, name), original in zip(_TARGETS, _saved.pop()[1]):
        setattr(module, name, original)


def active_checkpoints():
    """The `checkpoints` value of the innermost patch in force, or None if unpatched.

    Integrations (tape, Keras) read it to know whether, and how, to checkpoint.
    """
    return _saved[-1][0] if _saved else None


@contextlib.contextmanager
def checkpointing(checkpoints="memory"):
    """Context manager: tf.gradients checkpoints with `checkpoints` inside the block.

    Example:
      >>> with memory_saving_gradients.checkpointing("memory"):
      ...     grads = tf.gradients(loss, params)
    """
    patch_tf_gradients(checkpoints)
    try:
        yield
    finally:
        unpatch_tf_gradients()
