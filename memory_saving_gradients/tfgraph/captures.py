"""Gradients with respect to tensors of enclosing graphs, from inside a nested graph.

A cond branch, a while body or a nested tf.function is a FuncGraph of its
own; a tensor of an enclosing graph enters it as a placeholder (a capture).
tf.gradients called inside such a graph crosses those placeholders and goes on
through the enclosing graphs' ops down to the xs (the gradient ops are added
to the inner graph). We do the same in two steps: our rewrite takes the
gradients down to the captures, then stock tf.gradients carries them from
the captured tensors to the xs. Nothing of the enclosing graphs is
recomputed: their tensors are alive anyway while the inner graph runs.
"""

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import max_pool_grad_grad
from memory_saving_gradients.tfgraph.reading import region_ops


def encloses(outer, graph) -> bool:
    """True if `outer` is `graph` or one of the graphs it is nested in."""
    while graph is not None:
        if graph is outer:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def local_tensor(graph, tensor) -> Optional[tf.Tensor]:
    """The tensor of `graph` standing for `tensor`, or None if `graph` never captured it.

    `tensor` itself when it belongs to `graph`; else the placeholder `graph`
    captured it as, directly or through the placeholders of the graphs in
    between (a loop body in a function in a function). O(captures x depth).
    """
    if getattr(tensor, "graph", None) is graph:
        return tensor
    internal = _captured_as(graph, tensor)
    if internal is not None:
        return internal
    outer = getattr(graph, "outer_graph", None)
    in_outer = None if outer is None else local_tensor(outer, tensor)
    return None if in_outer is None else _captured_as(graph, in_outer)


def captured_source(tensor: tf.Tensor) -> tf.Tensor:
    """The tensor `tensor` stands for: where it is a placeholder its graph
    captured, the tensor captured (through every level of capturing), else
    `tensor`. The reverse of `local_tensor`; O(captures x depth)."""
    while tensor.op.type == "Placeholder":
        external = next((e for e, internal in getattr(tensor.graph, "captures", ())
                         if internal is tensor), None)
        if external is None:
            return tensor
        tensor = external
    return tensor


def _captured_as(graph, tensor):
    for external, internal in getattr(graph, "captures", ()):
        if external is tensor:
            return internal
    return None


def differentiable_captures(graph) -> List[Tuple[tf.Tensor, tf.Tensor]]:
    """(captured tensor, its placeholder in `graph`) for the captures a gradient can cross.

    Resource handles are left out: tf.gradients, too, stops at a variable
    handle's placeholder rather than following it to the enclosing graph.
    """
    return [(external, internal) for external, internal in getattr(graph, "captures", ())
            if internal.dtype.is_floating or internal.dtype.is_complex]


def beyond(entries: Sequence[Tuple[tf.Tensor, tf.Tensor]], entry_grads: Sequence,
           xs: Sequence[tf.Tensor], unconnected,
           stops: Sequence[tf.Tensor] = ()) -> List[Optional[tf.Tensor]]:
    """Gradients of `xs` (tensors of enclosing graphs), given those of the captures.

    `entry_grads[i]` is the gradient reaching the placeholder of `entries[i]`;
    stock tf.gradients carries it on from the captured tensor, through the
    enclosing graphs' ops, to each x (an x captured directly gets it as it is).
    `stops` (the caller's stop_gradients) stop that walk too, as they stop
    stock tf.gradients called in the inner graph.
    """
    reached = [(external, g) for (external, _), g in zip(entries, entry_grads) if g is not None]
    if not reached:
        zero = unconnected == tf.UnconnectedGradients.ZERO
        return [compat.zeros_like_gradient(x) if zero else None for x in xs]
    externals = [e for e, _ in reached]
    # As in rewrite.backprop: second orders through max pools without the
    # CPU MaxPoolGradGrad kernel, which can return zeros (max_pool_grad_grad.py).
    # (Of graph tensors: a capture of an eager tensor has no op.)
    with max_pool_grad_grad.argmax_gradients(region_ops(
            [e for e in externals if tf.is_symbolic_tensor(e)],
            [x for x in xs if tf.is_symbolic_tensor(x)])):
        return compat.stock_gradients(externals, list(xs),
                                      grad_ys=[g for _, g in reached],
                                      stop_gradients=list(stops) or None,
                                      unconnected_gradients=unconnected)
