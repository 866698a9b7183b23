"""Copying a level's segment so that it runs late, when backprop reaches it.

Copies read per-level identity stubs of the tensors on the segment's
boundary (checkpoints, weights, xs), so each level's tf.gradients call walks
only its own segment; ops that read no other copy wait for the gradient that
reaches the level, so the executor cannot run them during the forward pass.
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.core.planning import Level
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import conv_gradients
from memory_saving_gradients.tfgraph import loop_chunks
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import transposed_copies
from memory_saving_gradients.tfgraph.gradient_waits import wait_for_gate
from memory_saving_gradients.tfgraph.reading import Reading


class Boundary:
    """The tensors recomputation reads and must send gradients to.

    Those are checkpoints, weights (region tensors that are not activations)
    and xs. Copies read stubs of them, made per level: a stub's only
    consumers are that level's copies, so tf.gradients started from stubs
    walks one segment, not the whole graph.
    """

    def __init__(self, reading: Reading, kept, xs, graph: tf.Graph):
        self._reading = reading
        self._kept = frozenset(kept)
        self._x_names = frozenset(x.name for x in xs)
        self._xla = compat.in_xla_context(graph)

    def holds(self, name: str) -> bool:
        return name in self._kept or name in self._x_names or self._reading.is_weight(name)

    def stub(self, tensor: tf.Tensor, stubs: dict, level_gate) -> tf.Tensor:
        """The level's stub for `tensor` (made on first use), or `tensor` itself.

        `level_gate` (see `gate`) exists once the level may start. XLA
        (jit_compile) drops the control inputs that make copies wait for it,
        then runs the copies early or merges them with their originals (CSE,
        even through optimization barriers on CPU). So under XLA the stub of
        a float tensor also reads the gate: a data dependency XLA must
        respect. Integer tensors (shapes, indices) get none: they are small,
        and XLA needs shapes as compile-time constants.
        """
        if not self.holds(tensor.name):
            return tensor
        if tensor.name not in stubs:
            if (self._xla and level_gate is not None
                    and (tensor.dtype.is_floating or tensor.dtype.is_complex)):
                stub = wait_for_gate(tensor, level_gate)
            else:
                stub = tf.identity(tensor)
            # A variable read has no device of its own: its stub then keeps the
            # caller's device scope, which under tf.distribute is the replica's.
            if tensor.op.device:
                compat.set_device(stub.op, tensor.op.device)
            stubs[tensor.name] = stub
        return stubs[tensor.name]


def copy_level(graph: tf.Graph, level: Level, seeds: dict, level_gate, stub) -> dict:
    """Copies the level's ops; returns original tensor name -> copied tensor.

    `stub(tensor)` gives what a copy reads in place of a boundary tensor. Ops
    that read no other copy get control inputs on the gradients of the
    checkpoints they serve and on `level_gate` (None: none), so the executor
    runs them neither early nor while the previous phase's tensors live.
    """
    copies = {}
    for op_name in level.copy_ops:
        owners = [seeds[c] for c in level.owners[op_name] if c in seeds]
        if not owners:
            continue  # serves only checkpoints that receive no gradient
        op = graph.get_operation_by_name(op_name)
        inputs = [copies[i.name] if i.name in copies else stub(i) for i in op.inputs]
        waits = [] if any(i.name in copies for i in op.inputs) else (
            [g.op for g in owners] + ([level_gate.op] if level_gate is not None else []))
        if waits and op.type in loops.LOOP_OP_TYPES:
            # Differentiating a loop appends data inputs to it, and a node's
            # control inputs must follow its data inputs: it waits through them.
            with graph.control_dependencies(waits):
                inputs = [tf.identity(i) for i in inputs]
            waits = []
        elif waits and inputs:
            inputs, waits = waiting_through_input(graph, inputs, waits)
        if op.type in loops.LOOP_OP_TYPES:
            outputs = loop_chunks.copy_loop(op, inputs)  # in chunks if it can
        else:
            with graph.control_dependencies(waits):
                outputs = _copy_op(graph, op, inputs)
        for old_t, new_t in zip(op.outputs, outputs):
            new_t.set_shape(old_t.shape)
            copies[old_t.name] = new_t
    return copies


def waiting_through_input(graph: tf.Graph, inputs: list, waits: list) -> tuple:
    """(`inputs` with one of them read through an Identity that waits for
    `waits`, no control inputs left to add to the copy).

    The copy then waits as if it had the control inputs itself, but has none:
    grappler's remapper fuses no contraction with a control input
    (MatMul + BiasAdd + Relu into one _FusedMatMul, Conv2D likewise), and
    unfused, the first copy of each level of the 256-block MLP ran three
    kernels and wrote two more full-size buffers (docs/planner.md, "MLP-256
    step time"). A float input if there is one: an Identity takes no buffer
    of its own, and on a GPU an integer one would sit in host memory.
    """
    at = next((i for i, t in enumerate(inputs) if t.dtype.is_floating), 0)
    with graph.control_dependencies(waits):
        waiting = tf.identity(inputs[at])
    if inputs[at].op.device:
        compat.set_device(waiting.op, inputs[at].op.device)
    return inputs[:at] + [waiting] + inputs[at + 1:], []


def _copy_op(graph: tf.Graph, op: tf.Operation, inputs: list) -> list:
    """The outputs of a copy of `op` reading `inputs`, on `op`'s device.

    A transposed convolution we differentiate scratch-free is recomputed
    scratch-free too: the stock CPU kernel's scratch (16-33 MiB at batch 8)
    would come back at every recomputation.
    """
    if not transposed_copies.recomputes_scratch_free(op):
        new = compat.create_op_copy(graph, op, inputs)
        compat.set_device(new, op.device)
        return new.outputs
    first_new = len(graph.get_operations())
    with graph.as_default():
        output = conv_gradients.scratch_free_transposed_copy(op, inputs)
    for new in graph.get_operations()[first_new:]:
        compat.set_device(new, op.device)
    return [output]
