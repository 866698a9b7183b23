"""Which tf.function-style (v2) while loops may be rerun during backprop.

Rerunning a loop late frees the per-iteration state its gradient keeps, most
of a recurrent network's memory. A rerun must see what the forward pass saw:

* its condition and body draw no random numbers and write no state; reading
  variables is allowed;
* its body holds no nested functional op (If, While, Case, function calls):
  the rerun differentiates function graphs rebuilt from their FunctionDefs,
  and those lose what nested control flow needs (resource handle data, the
  gradient functions of inner loops); tf.gradients then raises or silently
  gives wrong gradients;
* its body holds no `tf.custom_gradient` (`tf.nn.silu`, Keras' swish): the
  gradient is a Python closure over the tensors of the trace that made it,
  which the rebuilt body cannot reach (tf.gradients raises);
* no variable it reads may be assigned between the forward pass and the
  rerun, through any handle that may point to it (writers.py), including by
  the body of another loop;
* in a tf.compat.v1 graph run by a Session, it reads no variable at all: an
  assign made after the `gradients` call (ordered after the loss only) may
  run before the rerun, and ops made later cannot be seen or ordered here.
  A tf.function orders such an assign after the rerun (program order).

Anything else is kept, as any stateful op is.
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import aliasing
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import graph_cache
from memory_saving_gradients.tfgraph import purity
from memory_saving_gradients.tfgraph import writers

LOOP_OP_TYPES = frozenset({"While", "StatelessWhile"})
# The attribute tf.custom_gradient sets on its IdentityN: which Python closure is its gradient.
CUSTOM_GRADIENT_ATTR = "_gradient_op_type"


def rerunnable_loops(ops) -> set:
    """The v2 while loops among `ops` (of one graph) that give the same values when rerun."""
    loops = [op for op in ops if op.type in LOOP_OP_TYPES]
    if not loops:
        return set()
    graph = loops[0].graph
    found = graph_cache.per_graph(graph, writers.VariableWriters)
    return {op for op in loops
            if body_is_plain(graph, op) and not assigned_meanwhile(op, found)}


def body_is_plain(graph: tf.Graph, loop: tf.Operation) -> bool:
    """True if the loop's cond and body run only stateless ops and variable reads."""
    for part in ("cond", "body"):
        nodes = purity.function_nodes(graph, loop.get_attr(part).name)
        if nodes is None:
            return False
        if any(purity.called_functions(n) or not purity.stateless_or_read(n.op)
               or CUSTOM_GRADIENT_ATTR in n.attr for n in nodes):
            return False
    return True


def assigned_meanwhile(loop: tf.Operation, found: writers.VariableWriters) -> bool:
    """True if an op may assign a resource `loop` reads after the loop has run.

    Harmless writers: variable initializers, writers the loop waits for, and
    in a tf.function writers of the very handle the loop reads made before
    it (tf.function orders those in program order when tracing ends). Any
    other writer may run between the forward pass and the rerun (e.g. a
    GAN step that updates one model before differentiating the other). In a
    Session graph, writers made after this call are unknown: always True.
    """
    handles = aliasing.resources(loop.inputs)
    if not handles:
        return False
    if not compat.orders_stateful_ops(loop.graph):
        return True
    names = {t.name for t in handles}
    initializers = found.initializers()
    for writer in found.of(handles):
        if writer is loop or writer in initializers:
            continue
        if (compat.creation_id(writer) < compat.creation_id(loop)
                and names & {t.name for t in writer.inputs}):
            continue
        if loop not in found.runs_after(writer):
            return True
    return False
