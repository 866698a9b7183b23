"""Recomputing a segment in another graph: the backward function of a tf.function.

When a `tf.function` holding a segment is differentiated from outside (an
eager tape around it, or a step calling it as a nested function), TensorFlow
builds the gradient in a backward function graph of its own, and every
forward tensor that graph reads becomes an output of the forward function,
kept until backprop. Copying the segment's ops into the backward graph, to
run after the incoming gradient, makes it read only the segment's boundary:
its sources, the values of the variables it reads, and the outputs of ops
that must not run twice (random ops, other stateful ops).
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import copying
from memory_saving_gradients.tfgraph import effects
from memory_saving_gradients.tfgraph import gradient_paths


def recomputed_gradients(body_ops: Sequence[tf.Operation], reached: set, ys: list,
                         xs: list, grad_ys: list, stops: list) -> Optional[list]:
    """Gradients of `xs` from `ys` given `grad_ys`, stopping at `stops`,
    built in the default graph by copies of the body's ops on the way to
    `ys`; None where the copies cannot stand for the body: a gradient from
    `ys` reaches a cond, loop or function call, or an op not rerun (a
    stateful op) with an input tapes differentiate (float or complex) in
    `reached`, the ids of the tensors the sources reach. Such ops that no
    gradient reaches (behind `tf.stop_gradient`) are kept (`_kept_behind_stops`).

    Every forward tensor is read through the default graph's capture of it:
    xs, stops and kept tensors are the boundary. The copies of ops reading
    no other copy wait for `grad_ys`, so they run when backprop reaches the
    segment, not while the forward function runs.
    """
    graph = tf.compat.v1.get_default_graph()
    if not hasattr(graph, "capture"):  # not a function graph: no way to read the body's
        return None
    kept = _kept_behind_stops(body_ops, reached, ys)
    if kept is None:
        return None
    needed = _ops_feeding(ys, [op for op in body_ops if op not in kept])
    waits = [t.op for t in tf.nest.flatten(grad_ys, expand_composites=True)]
    copies = {}
    for op in body_ops:
        if op not in needed or not _reruns(op):
            continue  # a kept op: its outputs are read from the forward graph
        inputs = [copies.get(id(t), t) for t in op.inputs]
        if inputs and not any(id(t) in copies for t in op.inputs):
            inputs, _ = copying.waiting_through_input(graph, inputs, waits)
        with graph.control_dependencies([] if inputs else waits):
            # Colocation names ops of the body's graph, which this one lacks.
            attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
            copy = compat.create_op_copy(graph, op, inputs, attrs=attrs, keep_shapes=True)
        compat.set_device(copy, op.device)
        copies.update(zip(map(id, op.outputs), copy.outputs))

    def local(tensor):
        copied = copies.get(id(tensor))
        return graph.capture(tensor) if copied is None else copied
    return compat.stock_gradients([local(y) for y in ys], [local(x) for x in xs],
                                  grad_ys=grad_ys, stop_gradients=[local(s) for s in stops])


def _kept_behind_stops(body_ops: Sequence[tf.Operation], reached: set,
                       ys: list) -> Optional[set]:
    """The ops on the way to `ys` a copy cannot stand for (a cond, loop or
    function call, or an op not rerun with an input in `reached` that tapes
    differentiate), and those their outputs feed up to where a gradient
    from `ys` stops (`tf.stop_gradient`, a comparison, a cast from one) or
    that read nothing else in `reached` (a reduction past the stop): all
    kept, read from the forward graph. None if a gradient reaches one of the
    first kind, or could from what the copies read of them (below).

    Read past the stop, not at the kept op: a second order differentiates
    the forward function from every tensor the backward one captures, and
    from a `tf.py_function`'s (or a random gamma's) own output TensorFlow
    would build that op's gradient, which raises. A `PreventGradient` among
    them keeps TensorFlow's gradient, which raises there as stock does."""
    needed = _ops_feeding(ys, body_ops)
    first = {op for op in needed if gradient_paths.holds_functions(op) or not _reruns(op) and any(
        compat.is_trainable(t) and id(t) in reached for t in op.inputs)}
    if not first:
        return first
    coming_back = gradient_paths.gradient_comes_back_from(body_ops, ys)

    def carries_gradient(tensor):
        return compat.is_trainable(tensor) and id(tensor) in coming_back

    if any(carries_gradient(t) for op in first for t in op.outputs):
        return None
    kept = set(first)
    for op in body_ops:  # in creation order: inputs before readers
        if op not in needed or not any(t.op in kept for t in op.inputs):
            continue
        passes_back = (any(carries_gradient(t) for t in op.outputs)
                       and gradient_paths.passes_gradient(op)
                       and any(compat.is_trainable(t) for t in gradient_paths.graded_inputs(op)))
        if not passes_back or all(t.op in kept for t in op.inputs if id(t) in reached):
            kept.add(op)
    read = [t for op in needed - kept for t in op.inputs if t.op in kept]
    read += [y for y in ys if y.op in kept]
    behind = gradient_paths.gradient_comes_back_from(list(kept), read)
    if any(op.type == "PreventGradient" for op in kept) or any(
            compat.is_trainable(t) and id(t) in behind for op in first for t in op.outputs):
        return None
    return kept


def _reruns(op: tf.Operation) -> bool:
    """Whether a copy of `op` gives what `op` gave. A variable's read is kept,
    not rerun: the body (or the step) may assign the variable before backprop.
    So is a placeholder (the body's capture of a tensor from outside its
    graph, made at its first read): a copy would be fed nothing."""
    return op.type != "Placeholder" and effects.type_reruns_identically(op.type)


def _ops_feeding(ys: list, body_ops: Sequence[tf.Operation]) -> set:
    """The body's ops that `ys` depend on through data inputs."""
    body, found = set(body_ops), set()
    stack = [y.op for y in ys if y.op in body]
    while stack:
        op = stack.pop()
        if op not in found:
            found.add(op)
            stack.extend(t.op for t in op.inputs if t.op in body)
    return found
