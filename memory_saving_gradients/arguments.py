"""Argument checks of the public entry points: what a user passes, made into graph tensors.

Every malformed argument is refused here with an error that names it and the
fix, before any graph is read.
"""

from __future__ import annotations

import collections.abc

import tensorflow as tf

from memory_saving_gradients.tfgraph import captures
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import replicas
from memory_saving_gradients.tfgraph.variables import as_tf_variable

_TF_GRADIENTS_ARGS = frozenset({
    "name", "colocate_gradients_with_ops", "gate_gradients", "aggregation_method",
    "stop_gradients", "unconnected_gradients"})


def check_keywords(kwargs) -> None:
    """Refuses keywords tf.compat.v1.gradients does not take."""
    unknown = set(kwargs) - _TF_GRADIENTS_ARGS
    if unknown:
        raise TypeError(f"gradients() got unexpected keyword arguments {sorted(unknown)}; "
                        f"it accepts those of tf.compat.v1.gradients: "
                        f"{sorted(_TF_GRADIENTS_ARGS)}")


def tf_gradients_options(kwargs) -> tuple:
    """(stop_gradients, unconnected_gradients, name, the rest) of `gradients`' keywords.

    The rest are passed on to tf.gradients as they are.
    """
    rest = dict(kwargs)
    stops = rest.pop("stop_gradients", None)
    stops = [] if stops is None else as_tensors(stops, "stop_gradients")
    unconnected = unconnected_gradients(
        rest.pop("unconnected_gradients", tf.UnconnectedGradients.NONE))
    return stops, unconnected, rest.pop("name", None) or "gradients", rest


def unconnected_gradients(value):
    try:
        return tf.UnconnectedGradients(value)
    except ValueError:
        raise ValueError(f"unconnected_gradients={value!r} is not valid: use 'none' or "
                         f"'zero' (tf.UnconnectedGradients.NONE or .ZERO)") from None


def normalise(ys, xs, grad_ys):
    if tf.executing_eagerly():
        raise RuntimeError(
            "memory_saving_gradients works on graphs, and TensorFlow is executing "
            "eagerly: wrap the training step in tf.function (or build a "
            "tf.compat.v1 graph), as tf.gradients requires too")
    replicas.check_arguments((("ys", ys), ("xs", xs), ("grad_ys", grad_ys)))
    ys = as_tensors(ys, "ys", allow_variables=True)
    if not ys:
        raise ValueError("ys is empty: pass the tensor(s) to differentiate")
    xs = as_tensors(xs, "xs", allow_variables=True)
    graph = ys[0].graph
    if graph is not tf.compat.v1.get_default_graph():
        raise ValueError(f"ys belong to graph {graph}, but the default graph is "
                         f"another: call gradients inside the graph or tf.function "
                         f"that built ys")
    check_same_graph(ys, graph, "ys")
    for x in xs:
        if not captures.encloses(x.graph, graph):
            check_same_graph([x], graph, "xs")
    if grad_ys is not None:
        grad_ys = seeds(grad_ys, ys)
        check_same_graph([g for g in grad_ys if g is not None], graph, "grad_ys")
    return ys, xs, grad_ys


def seeds(grad_ys, ys):
    """One seed (or None) per y, of its dtype and a shape compatible with it.

    Python numbers, lists and numpy arrays become constants of the y's dtype,
    as tf.gradients accepts them. A seed of another shape is refused even
    where broadcasting would run: a transposed seed is never what was meant.
    """
    if not isinstance(grad_ys, (list, tuple)):
        grad_ys = [grad_ys]
    if len(grad_ys) != len(ys):
        raise ValueError(f"grad_ys has {len(grad_ys)} entries but ys has {len(ys)}; "
                         f"pass one gradient (or None) per y")
    seeds = []
    for i, (seed, y) in enumerate(zip(grad_ys, ys)):
        where = f"grad_ys[{i}]"
        if seed is not None and not isinstance(seed, tf.IndexedSlices):
            if is_tensor_like(seed):
                seed = as_tensors(seed, where, allow_variables=True)[0]
            else:
                seed = constant_like(seed, y, where)
            check_seed(seed, y, where)
        seeds.append(seed)
    return seeds


def is_tensor_like(value):
    return isinstance(as_tf_variable(value), tf.Variable) or tf.is_symbolic_tensor(value)


def constant_like(value, y, where):
    try:
        return tf.constant(value, dtype=y.dtype)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{where} cannot be made a {y.dtype.name} tensor for y "
                        f"{y.name}: {error}") from None


def check_seed(seed, y, where):
    if seed.dtype.base_dtype != y.dtype.base_dtype:
        raise TypeError(f"{where} has dtype {seed.dtype.name} but y {y.name} has "
                        f"{y.dtype.name}; cast it: tf.cast({where}, tf.{y.dtype.name})")
    if not seed.shape.is_compatible_with(y.shape):
        raise ValueError(f"{where} has shape {seed.shape} but y {y.name} has shape "
                         f"{y.shape}; pass a gradient shaped like its y")


def as_tensors(values, what, allow_variables=False, allow_none=False):
    """A list of graph tensors; variables (tf or Keras) as xs become what
    tf.gradients differentiates (a handle, or a v1 variable's reference)."""
    if isinstance(values, (tf.Tensor, tf.Variable, tf.IndexedSlices)) or values is None:
        values = [values]
    elif not isinstance(values, collections.abc.Iterable) or isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a tensor or a list of tensors, got "
                        f"{type(values).__name__}: {values!r}")
    out = []
    for i, v in enumerate(values):
        v = as_tf_variable(v)
        if v is None and allow_none:
            out.append(None)
        elif isinstance(v, tf.Variable) and allow_variables:
            out.append(compat.differentiable_source(v) if what == "xs"
                       else tf.convert_to_tensor(v))
        elif tf.is_symbolic_tensor(v):
            out.append(v)
        elif what == "xs" and isinstance(v, tf.Tensor) and in_function():
            out.append(tf.convert_to_tensor(v))  # an eager tensor: captured, as tf.gradients does
        else:
            raise TypeError(f"{what}[{i}] must be a tf.Tensor in a graph, got "
                            f"{type(v).__name__}: {v!r}")
    return out


def in_function():
    return hasattr(tf.compat.v1.get_default_graph(), "captures")  # a tf.function's FuncGraph


def check_same_graph(tensors, graph, what):
    for t in tensors:
        if t.graph is not graph:
            raise ValueError(f"{what} tensor {t.name} belongs to a different graph than "
                             f"ys; build all tensors in one graph or tf.function")
