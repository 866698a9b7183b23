"""Keras `model.fit` with checkpointing: a callback, or enable/disable.

Keras (3, and tf_keras) computes each training step's gradients with a
GradientTape inside the train function it traces. `enable` wraps the model's
`train_step` (Keras's own or the user's) so that checkpointing is active while
that step is traced: the tape hook (integrations/tape.py) answers its
`tape.gradient` with our rewrite, and `patching.active_checkpoints()` tells
other integrations which checkpoints apply. The train function is rebuilt so
Keras traces the wrapped step. Evaluation and prediction are not touched.
"""

import contextlib
import logging

import tensorflow as tf

from memory_saving_gradients import api
from memory_saving_gradients.integrations import optimizer_waits
from memory_saving_gradients.integrations import patching
from memory_saving_gradients.tfgraph import compat

logger = logging.getLogger("memory_saving_gradients")

_ENABLED = "_memory_saving_gradients_enabled"  # model attribute: what enable replaced


class _Replaced:
    """What `enable` replaced on a model, for `disable` to put back."""

    def __init__(self, checkpoints, own_train_step):
        self.checkpoints = checkpoints
        self.own_train_step = own_train_step  # an instance attribute the user set, or None
        self.by_callback = False  # set by Checkpointing, whose fit may end without on_train_end


def check_keras_checkpoints(checkpoints) -> None:
    """`gradients`' check, plus: Keras steps take a mode, not a list of tensors."""
    if api.validate_checkpoints(checkpoints) == "list":
        raise TypeError(
            f"Keras checkpointing takes a mode ({', '.join(map(repr, api.MODES))}), got "
            f"{type(checkpoints).__name__}: the tensors of a Keras training step exist only "
            f"inside the train function Keras traces, so a list cannot name them; use a "
            f"mode, or memory_saving_gradients.gradients in a custom train_step")


def enable(model, checkpoints="memory") -> None:
    """Makes `model.fit` (and train_on_batch) checkpoint every training step.

    Args:
      model: a compiled Keras model (Keras 3 or tf_keras).
      checkpoints: a mode accepted by `gradients` ('memory', 'speed', 'collection').

    Raises:
      ValueError / TypeError: `checkpoints` is malformed (the error `gradients` gives).
      RuntimeError: the model is not compiled, or checkpointing is already enabled.
    """
    check_keras_checkpoints(checkpoints)
    if not _is_compiled(model):
        raise RuntimeError(f"model {model.name!r} is not compiled: call model.compile(...) "
                           f"before enabling checkpointing")
    _undo_failed_fit(model)
    if getattr(model, _ENABLED, None) is not None:
        raise RuntimeError(
            f"checkpointing is already enabled on model {model.name!r} (checkpoints="
            f"{getattr(model, _ENABLED).checkpoints!r}): call "
            f"memory_saving_gradients.keras.disable(model) first, or pass the Checkpointing "
            f"callback without calling enable()")
    step = model.train_step
    replaced = _Replaced(checkpoints, model.__dict__.get("train_step"))
    keras_own_step = replaced.own_train_step is None and getattr(
        type(model).train_step, "__qualname__", "") == "TensorFlowTrainer.train_step"

    @tf.autograph.experimental.do_not_convert
    def train_step(data):
        with patching.checkpointing(checkpoints), (
                api.weight_gradients_taken()
                if keras_own_step and optimizer_waits.takes_each_gradient(model.optimizer)
                else contextlib.nullcontext()):
            return step(data)

    object.__setattr__(model, "train_step", train_step)
    object.__setattr__(model, _ENABLED, replaced)
    _retrace(model)


def disable(model) -> None:
    """Undoes `enable`; a warning (no error) if checkpointing was not enabled."""
    replaced = getattr(model, _ENABLED, None)
    if replaced is None:
        logger.warning("memory_saving_gradients: checkpointing was not enabled on model "
                       "%r; nothing to disable", getattr(model, "name", model))
        return
    object.__delattr__(model, "train_step")
    model.__dict__.pop("make_train_function", None)  # set by the callback's enable
    if replaced.own_train_step is not None:
        object.__setattr__(model, "train_step", replaced.own_train_step)
    object.__setattr__(model, _ENABLED, None)
    _retrace(model)


def _undo_failed_fit(model) -> None:
    """Disables what a Checkpointing callback enabled in a fit that raised.

    Such a fit skips on_train_end, so the callback could not undo its enable.
    """
    left = getattr(model, _ENABLED, None)
    if left is not None and left.by_callback:
        logger.warning("memory_saving_gradients: a fit with the Checkpointing callback on "
                       "model %r ended without on_train_end (it raised); checkpointing it "
                       "enabled is disabled now", model.name)
        disable(model)


def _until_next_build(model) -> None:
    """Marks the callback's enable as lasting only for the fit in progress.

    That fit built its train function before on_train_begin; the next `fit`
    or `train_on_batch` asks for one again (not forced): if the callback's
    fit raised, checkpointing is still enabled then, and is undone first so
    the cached checkpointed train function is not reused.
    """
    stock_make = model.make_train_function

    def make_train_function(force=False):
        if not force:
            _undo_failed_fit(model)  # disable() removes this wrapper too
        return stock_make(force)
    object.__setattr__(model, "make_train_function", make_train_function)


def enabled_checkpoints(model):
    """The checkpoints value `enable` set on `model`, or None."""
    replaced = getattr(model, _ENABLED, None)
    return None if replaced is None else replaced.checkpoints


def _is_compiled(model) -> bool:
    # Keras 3 has `compiled`; tf_keras keeps the flag in `_is_compiled`.
    return bool(getattr(model, "compiled", getattr(model, "_is_compiled", False)))


def _retrace(model) -> None:
    """Makes Keras build (and so trace) a new train function on the next step.

    Inside `fit` the function is already built when callbacks start, so it is
    rebuilt at once; `fit` reads `model.train_function` at every step.
    """
    model.train_function = None
    model.make_train_function(force=True)


class Checkpointing(tf.keras.callbacks.Callback):
    """Keras callback: every training step of this `fit` checkpoints with `checkpoints`.

    Example:
      >>> model.fit(x, y, callbacks=[memory_saving_gradients.keras.Checkpointing("memory")])

    Validation and prediction run as without it. An unknown mode fails here,
    with the error `gradients` gives.
    """

    def __init__(self, checkpoints="memory"):
        super().__init__()
        check_keras_checkpoints(checkpoints)
        self.checkpoints = checkpoints

    def on_train_begin(self, logs=None):
        enable(self.model, self.checkpoints)
        getattr(self.model, _ENABLED).by_callback = True
        _until_next_build(self.model)

    def on_train_end(self, logs=None):
        disable(self.model)
