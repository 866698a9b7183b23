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
from typing import Callable, Optional

import keras
import tensorflow as tf
from keras.src.backend.common import global_state

from memory_saving_gradients.tfgraph import compat

logger = logging.getLogger("memory_saving_gradients")

_functions = weakref.WeakKeyDictionary()  # layer -> {Python state: tf.function}
_plain = weakref.WeakSet()  # layers run as written, said once each
# Distinct Python states a layer is traced for before it runs as written.
_MOST_STATES = 8

NOT_TRACED = object()


def call(decorated: Callable, layer: keras.layers.Layer, args: tuple, kwargs: dict):
    """`decorated(layer, *args, **kwargs)` through the layer's tf.function;
    NOT_TRACED where it cannot go through one (said once per layer), to be
    run as it is."""
    if layer in _plain:
        return NOT_TRACED
    state = _python_state(layer)
    if state is None:
        return _runs_as_written(layer, "a Keras call-context argument such as `training` "
                                       "is a tensor, not a Python value")
    functions = _functions.setdefault(layer, {})
    if state not in functions:
        if len(functions) == _MOST_STATES:
            del _functions[layer]
            return _runs_as_written(layer, f"the Python values its call reads (attributes "
                                           f"of it or its sublayers) took more than "
                                           f"{_MOST_STATES} values, one trace each")
        functions[state] = _TracedCall(decorated, weakref.ref(layer))
    try:
        return functions[state](args, kwargs)
    except _TraceFailed as failure:
        return _runs_as_written(layer, f"its call cannot be traced into a tf.function: "
                                       f"{_last_line(failure.__cause__)}")


def _runs_as_written(layer: keras.layers.Layer, why: str):
    _plain.add(layer)
    logger.warning("memory_saving_gradients: %s: @recompute_grad runs eagerly and is not "
                   "recomputed, as %s; train in a tf.function (Keras's default) to save "
                   "memory", type(layer).__name__, why)
    return NOT_TRACED


def _last_line(error: Exception) -> str:
    """What went wrong, from an error TensorFlow raised while tracing (whose
    message starts with the traceback of the user's code)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


class _TraceFailed(Exception):
    """The body raised while traced (it may run eagerly only: `.numpy()`, a
    tensor stored on the layer); an error while the function runs is the body's."""


class _TracedCall:
    """The decorated call as a tf.function.

    Its inputs are the call's arguments, their Keras masks, and the tensors
    stored as attributes of the layer and its sublayers (a memory another
    layer set): set on the layers while traced, they are read as inputs, so a
    tape sees them and a new tensor there is no stale capture. A tf.function's
    outputs are tensors, so the call's other values (None, Python numbers,
    strings) are kept per trace and put back; so are the Keras masks of its
    outputs, and the losses it added, taken off the graph's layers and added
    again outside.
    """

    def __init__(self, decorated: Callable, layer_ref: Callable):
        self._decorated, self._layer_ref = decorated, layer_ref
        # A partial, not the bound method: TensorFlow counts traces per code
        # object, and one trace of each layer would read as retracing.
        self._function = tf.function(functools.partial(_TracedCall._traced, self),
                                     reduce_retracing=True)
        self._structures = []  # per trace: what the call returned, tensors as None
        self._failed = False

    def __call__(self, args: tuple, kwargs: dict):
        layers = _sublayers(self._layer_ref())
        masks = [compat.keras_mask(t) for t in tf.nest.flatten((args, kwargs))
                 if isinstance(t, tf.Tensor)]
        try:
            trace, tensors, out_masks, losses = self._function(
                args, kwargs, masks, _tensor_attributes(layers))
        except Exception as error:
            if self._failed:
                raise _TraceFailed() from error
            raise
        structure = self._structures[int(trace)]
        leaves = iter(tensors)
        made = tf.nest.map_structure(
            lambda v: v.value if isinstance(v, _PythonValue) else next(leaves), structure)
        for tensor, mask in zip(tensors, out_masks):
            compat.set_keras_mask(tensor, mask)
        for owner, added in zip(layers, losses):
            for loss in added:
                owner.add_loss(loss)
        return made

    def _traced(self, args, kwargs, masks, attributes):
        layer = self._layer_ref()
        layers = _sublayers(layer)
        for tensor, mask in zip((t for t in tf.nest.flatten((args, kwargs))
                                 if isinstance(t, tf.Tensor)), masks):
            compat.set_keras_mask(tensor, mask)
        counts = [len(_losses(each)) for each in layers]
        outside = _tensor_attributes(layers)
        _set_tensor_attributes(layers, attributes)
        try:
            made = self._decorated(layer, *args, **kwargs)
            _check_nothing_kept_outside(layers, attributes, outside)
        except Exception:
            self._failed = True
            raise
        finally:
            _set_tensor_attributes(layers, outside)
            added = [_losses(each)[count:] for each, count in zip(layers, counts)]
            for each, count in zip(layers, counts):
                del _losses(each)[count:]
        tensors = [v for v in tf.nest.flatten(made) if tf.is_tensor(v)]
        self._structures.append(tf.nest.map_structure(
            lambda v: None if tf.is_tensor(v) else _PythonValue(v), made))
        return (len(self._structures) - 1, tensors, [compat.keras_mask(t) for t in tensors],
                added)


def _check_nothing_kept_outside(layers: list, given: dict, outside: dict) -> None:
    """Raises where the traced body left a tensor of its graph on a layer
    (`self.scores = ...`) other than the input `given` for it: it would be
    unusable after the function. Or where it read a large eager tensor it
    was not given (a global, `outside` the attributes): the function would
    keep reading the one it captured."""
    graph = tf.compat.v1.get_default_graph()
    for index, each in enumerate(layers):
        for name, value in vars(each).items():
            if (isinstance(value, tf.Tensor) and getattr(value, "graph", None) is graph
                    and value is not given.get((index, name))):
                raise ValueError(f"it keeps a tensor on a layer ({type(each).__name__}."
                                 f"{name})")
    given = {id(t) for t in outside.values()}
    for external, _ in compat.captured_pairs(graph):
        if compat.is_eager_tensor(external) and external.dtype != tf.resource \
                and id(external) not in given:
            raise ValueError(f"it reads a tensor made outside it that is neither an "
                             f"argument nor an attribute of a layer (shape "
                             f"{external.shape}); pass it as an argument")


class _PythonValue:
    """A value the call returned that is not a tensor (a leaf to tf.nest)."""

    def __init__(self, value):
        self.value = value


# Keras 3's private state, read here only.

def _python_state(layer: keras.layers.Layer) -> Optional[tuple]:
    """The Python state a Keras body reads besides its arguments and
    tensors: the call context's values (`training`, registered call-context
    arguments), the autocast dtype, and of the layer and its sublayers,
    whether each is trainable and their public attributes holding Python
    numbers, strings or None. None where a call-context value is not such a
    value (a tensor passed as `training`), which cannot key a cache."""
    context = global_state.get_global_attribute("current_call_ctx")
    values = sorted((name, value) for name, value in vars(context).items()
                    if name != "entry_layer") if context is not None else []
    if not all(_is_python_value(value) for _, value in values):
        return None
    scope = global_state.get_global_attribute("autocast_scope")
    attributes = tuple(
        (each.trainable,) + tuple(sorted(
            (name, value) for name, value in vars(each).items()
            if not name.startswith("_") and _is_python_value(value)))
        for each in _sublayers(layer))
    return tuple(values), getattr(scope, "dtype", None), attributes


def _is_python_value(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _tensor_attributes(layers: list) -> dict:
    """{(index of the layer, attribute name): tensor} of the eager tensors
    stored as attributes of `layers` (one a graph left there is not read)."""
    return {(index, name): value for index, each in enumerate(layers)
            for name, value in vars(each).items() if compat.is_eager_tensor(value)}


def _set_tensor_attributes(layers: list, attributes: dict) -> None:
    """Sets each of `attributes` (as `_tensor_attributes` gives them) on its
    layer, past Keras's attribute tracking (tensors are not tracked)."""
    for (index, name), value in attributes.items():
        vars(layers[index])[name] = value


def _sublayers(layer: keras.layers.Layer) -> list:
    """`layer` and the layers it tracks, at any depth, in a stable order."""
    return layer._flatten_layers()  # pylint: disable=protected-access


def _losses(layer: keras.layers.Layer) -> list:
    """The list `add_loss` appends `layer`'s own losses to."""
    return layer._losses  # pylint: disable=protected-access
