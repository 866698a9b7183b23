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
    `ys`; None where the copies cannot stand for the body: it holds a cond,
    loop or function call, or an op not rerun (a stateful op) on a gradient
    path (an input tapes differentiate, float or complex, in `reached`, the
    ids of the tensors the sources reach).

    Every forward tensor is read through the default graph's capture of it:
    xs, stops and kept tensors are the boundary. The copies of ops reading
    no other copy wait for `grad_ys`, so they run when backprop reaches the
    segment, not while the forward function runs.
    """
    graph = tf.compat.v1.get_default_graph()
    if not hasattr(graph, "capture"):  # not a function graph: no way to read the body's
        return None
    needed = _ops_feeding(ys, body_ops)
    if any(gradient_paths.holds_functions(op) or not _reruns(op) and any(
            compat.is_trainable(t) and id(t) in reached for t in op.inputs) for op in needed):
        return None
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
