"""Monkey-patching: route every tf.gradients call in the process to a mode.

The classic one-liner still works::

    tf.__dict__["gradients"] = memory_saving_gradients.gradients_memory

These helpers do the same for both tf.gradients and tf.compat.v1.gradients,
and put the originals back.
"""

import contextlib
import functools

import tensorflow as tf

from memory_saving_gradients import api

_TARGETS = ((tf, "gradients"), (tf.compat.v1, "gradients"))
_saved = []  # stack of (checkpoints, the functions it replaced), for nesting


def patch_tf_gradients(checkpoints="memory") -> None:
    """Makes tf.gradients and tf.compat.v1.gradients checkpoint with `checkpoints`.

    `checkpoints` is any value `gradients` accepts ('memory', 'speed',
    'collection' or a list of tensors). Undo with `unpatch_tf_gradients()`.
    """
    api.validate_checkpoints(checkpoints)
    replacement = tf.autograph.experimental.do_not_convert(
        functools.partial(api.gradients, checkpoints=checkpoints))
    _saved.append((checkpoints, [getattr(module, name) for module, name in _TARGETS]))
    for module, name in _TARGETS:
        setattr(module, name, replacement)


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
