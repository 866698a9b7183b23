"""Which ops of a graph may assign a variable, and which ops run after them.

Read once per graph and kept up to date (see `graph_cache`): a graph with
many loops reading one variable, or many `gradients` calls, is analysed once.
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import aliasing
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import purity

# Ops that run Python, which may assign any variable without taking its handle.
_PYTHON_OP_TYPES = frozenset({"PyFunc", "EagerPyFunc"})


def _may_write(op: tf.Operation, functions: purity.FunctionPurity) -> bool:
    """True if `op` may assign a variable (conservative)."""
    if compat.op_def(op.type) is not None and purity.stateless_or_read(op.type):
        return False
    names = purity.called_functions(op.node_def)
    if names:
        return not all(functions.only_reads(name) for name in names)
    return bool(aliasing.resources(op.inputs)) or op.type in _PYTHON_OP_TYPES


class VariableWriters:
    """The possible variable writers of one graph, with the handles each may write."""

    def __init__(self, graph: tf.Graph):
        self._graph = graph
        self.functions = purity.FunctionPurity(graph)
        self._handles = aliasing.HandleGroups(graph)
        self._after = {}  # writer -> the ops that run after it
        # (op, names of the handles it may write through, or None: any variable).
        # Without a handle input, only Python or a function may find a
        # variable (by its shared name); stateful ops like random ones write none.
        self._writers = []
        self._add_writers(graph.get_operations())

    def add_ops(self, ops: list) -> None:
        self._handles.add_ops(ops)
        self._add_writers(ops)
        self._after.clear()  # new ops may run after old writers

    def _add_writers(self, ops: list) -> None:
        for op in ops:
            # Loops too: a loop whose body assigns a variable writes it.
            if _may_write(op, self.functions):
                handles = [t.name for t in aliasing.resources(op.inputs)]
                self._writers.append((op, handles or None))

    def initializers(self) -> set:
        graph = self._graph
        variables = graph.get_collection("variables") + graph.get_collection("local_variables")
        return {getattr(v, "initializer", None) for v in variables}

    def of(self, handles) -> list:
        """The writers that may assign a variable behind any of `handles`."""
        read = {self._handles.group(t.name) for t in handles}
        return [op for op, written in self._writers
                if written is None or read & {self._handles.group(n) for n in written}]

    def runs_after(self, writer: tf.Operation) -> set:
        """Ops that run after `writer`: its descendants by data and control edges."""
        if writer not in self._after:
            after = set()
            stack = [writer]
            while stack:
                op = stack.pop()
                children = [c for t in op.outputs for c in t.consumers()]
                for child in children + compat.control_outputs(op):
                    if child not in after:
                        after.add(child)
                        stack.append(child)
            self._after[writer] = after
        return self._after[writer]
