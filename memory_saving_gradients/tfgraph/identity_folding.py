"""Whether Grappler's constant folding makes `x * 1` an Identity of x.

It does in a tf.function's graph while constant folding runs
(`compat.folds_constants`), unless an op of the step may write its inputs in
place or reads a reference: Grappler then makes such a product a Snapshot,
which copies x wherever x is read elsewhere. Measured on a chain of 16
`tf.nn.silu` (whose gradient computes `beta * features` with beta = 1):
stock's step peaks at 33 MB, and at 48 MB with one `InplaceAdd` elsewhere in
the step, in a nested tf.function or in a `tf.cond` branch (Grappler sees the
step with its calls inlined and its conds lowered). Ops added to the step
after it is read (an update later in the same function) are not seen.
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import graph_cache

# Grappler's own exceptions: these write a variable, not an input tensor.
_VARIABLE_WRITES = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ResourceScatterUpdate", "ResourceScatterAdd", "ResourceScatterSub",
    "ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterMin", "ResourceScatterMax"})


def folds_to_identities(graph: tf.Graph) -> bool:
    """Whether `x * 1` in `graph` becomes x itself when the step runs: the
    whole step is looked at (the outermost function graph and every function
    it calls, `graph` being one of them). O(new ops)."""
    return (compat.folds_constants(graph) and not graph_cache.per_graph(
        compat.outermost_function_graph(graph), _InPlaceWrites).found)


class _InPlaceWrites:
    """Whether any op of a graph, or of a function it calls (a nested
    tf.function, a cond's branches, a loop's body), writes an input in place
    as Grappler tells (its op type says "inplace", or an `in_place` /
    `inplace` attribute is set), or reads a reference."""

    def __init__(self, graph: tf.Graph):
        self.found = False
        self._looked_at = set()  # function names
        self.add_ops(graph.get_operations())

    def add_ops(self, ops: list) -> None:
        for op in ops:
            if self.found:
                return
            self.found = (_writes_in_place(op.node_def)
                          or any(compat.is_ref_dtype(t.dtype) for t in op.inputs)
                          or self._calls_a_writer(op.graph, op.node_def))

    def _calls_a_writer(self, graph, node_def) -> bool:
        for name in compat.called_function_names(node_def):
            if name in self._looked_at:
                continue
            self._looked_at.add(name)
            definition = compat.function_definition(graph, name)
            if definition is not None and any(
                    _writes_in_place(node) or self._calls_a_writer(graph, node)
                    for node in definition.node_def):
                return True
        return False


def _writes_in_place(node_def) -> bool:
    if node_def.op in _VARIABLE_WRITES:
        return False
    attrs = node_def.attr
    return ("inplace" in node_def.op.lower()
            or any(name in attrs and attrs[name].b for name in ("in_place", "inplace")))
