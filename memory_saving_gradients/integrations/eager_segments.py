"""Decorated Keras layers called eagerly under a tape run through a tf.function of their own.

An eager GradientTape keeps every tensor the gradients of the ops it recorded
read, so a layer run op by op (Keras `run_eagerly=True`, a training loop with
no tf.function) keeps all its activations. Called through a tf.function, its
body is traced into a graph where the decorator makes it a segment; the tape
records one call, whose gradient TensorFlow builds in a graph of its own, where
the body's ops are copied (tfgraph/backward_copies.py): what the tape keeps is
the boundary.

The functions are cached per layer and per the Python state the body reads
besides its arguments (Keras's call context, `training` among it, and the
autocast dtype), which a tf.function's trace key does not see. Losses the body
adds (`add_loss`, activity regularizers) leave the function as outputs, so the
layer's losses are eager tensors, differentiable as without the function.
"""

import functools
import logging
import weakref
from typing import Callable

import keras
import tensorflow as tf

logger = logging.getLogger("memory_saving_gradients")

_functions = weakref.WeakKeyDictionary()  # layer -> {Python state: tf.function}
_plain = weakref.WeakKeyDictionary()  # layers whose body could not be traced -> why


NOT_TRACED = object()


def call(decorated: Callable, layer: keras.layers.Layer, args: tuple, kwargs: dict):
    """`decorated(layer, *args, **kwargs)` through the layer's tf.function;
    NOT_TRACED where its body cannot be traced (said once per layer), to be
    run as it is."""
    if layer in _plain:
        return NOT_TRACED
    functions = _functions.setdefault(layer, {})
    state = _python_state()
    if state not in functions:
        functions[state] = _TracedCall(decorated, weakref.ref(layer))
    try:
        return functions[state](args, kwargs)
    except _TraceFailed as failure:
        _plain[layer] = True
        logger.warning("memory_saving_gradients: %s: @recompute_grad runs eagerly and is "
                       "not recomputed, as its call cannot be traced into a tf.function "
                       "(%s); train in a tf.function (Keras's default) to save memory",
                       type(layer).__name__, _last_line(failure.__cause__))
        return NOT_TRACED


def _last_line(error: Exception) -> str:
    """What went wrong, from an error TensorFlow raised while tracing (whose
    message starts with the traceback of the user's code)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


class _TraceFailed(Exception):
    """The body raised while traced (it may run eagerly: `.numpy()`, Python
    branching on tensor values); an error while the function runs is the body's."""


class _TracedCall:
    """The decorated call as a tf.function. A tf.function's outputs are
    tensors, so the call's other values (None, Python numbers, strings) are
    kept per trace and put back; so are the Keras masks of its tensors, and
    the losses it added, taken off the graph's layers and added again outside."""

    def __init__(self, decorated: Callable, layer_ref: Callable):
        self._decorated, self._layer_ref = decorated, layer_ref
        # A partial, not the bound method: TensorFlow counts traces per code
        # object, and one trace of each layer would read as retracing.
        self._function = tf.function(functools.partial(_TracedCall._traced, self),
                                     reduce_retracing=True)
        self._structures = []  # per trace: what the call returned, tensors as None
        self._failed = False

    def __call__(self, args: tuple, kwargs: dict):
        try:
            trace, tensors, masks, losses = self._function(args, kwargs)
        except Exception as error:
            if self._failed:
                raise _TraceFailed() from error
            raise
        structure = self._structures[int(trace)]
        leaves = iter(tensors)
        made = tf.nest.map_structure(
            lambda v: v.value if isinstance(v, _PythonValue) else next(leaves), structure)
        for tensor, mask in zip(tensors, masks):
            if mask is not None:
                tensor._keras_mask = mask  # pylint: disable=protected-access
        layers = self._layer_ref()._flatten_layers()  # pylint: disable=protected-access
        for owner, added in zip(layers, losses):
            for loss in added:
                owner.add_loss(loss)
        return made

    def _traced(self, args, kwargs):
        layer = self._layer_ref()
        layers = layer._flatten_layers()  # pylint: disable=protected-access
        counts = [len(each._losses) for each in layers]  # pylint: disable=protected-access
        try:
            made = self._decorated(layer, *args, **kwargs)
        except Exception:
            self._failed = True
            raise
        losses = []
        for each, count in zip(layers, counts):
            losses.append(each._losses[count:])  # pylint: disable=protected-access
            del each._losses[count:]  # pylint: disable=protected-access
        leaves = tf.nest.flatten(made, expand_composites=False)
        tensors = [v for v in leaves if tf.is_tensor(v)]
        masks = [getattr(t, "_keras_mask", None) for t in tensors]
        self._structures.append(tf.nest.map_structure(
            lambda v: None if tf.is_tensor(v) else _PythonValue(v), made))
        return len(self._structures) - 1, tensors, masks, losses


class _PythonValue:
    """A value the call returned that is not a tensor (a leaf to tf.nest)."""

    def __init__(self, value):
        self.value = value


def _python_state() -> tuple:
    """The Python state a Keras body reads besides its arguments: the call
    context's values (`training`, registered call-context arguments) and the
    autocast dtype."""
    from keras.src.backend.common import global_state  # pylint: disable=import-outside-toplevel
    context = global_state.get_global_attribute("current_call_ctx")
    values = sorted((name, value) for name, value in vars(context).items()
                    if name != "entry_layer") if context is not None else []
    scope = global_state.get_global_attribute("autocast_scope")
    return tuple(values), getattr(scope, "dtype", None)
