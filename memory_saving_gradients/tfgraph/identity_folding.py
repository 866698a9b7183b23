"""Whether Grappler's constant folding makes `x * 1` an Identity of x.

It does in a tf.function's graph while constant folding runs
(`compat.folds_constants`), unless an op of the graph may write its inputs in
place or reads a reference: Grappler then makes such a product a Snapshot,
which copies x wherever x is read elsewhere. Measured on a chain of 16
`tf.nn.silu` (whose gradient computes `beta * features` with beta = 1):
stock's step peaks at 34 MB, and at 48 MB with one `InplaceAdd` elsewhere in
the step. Ops added to the graph after it is read (an update later in the
same function) are not seen.
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
    """Whether `x * 1` in `graph` becomes x itself when the graph runs. O(new ops)."""
    return (compat.folds_constants(graph)
            and not graph_cache.per_graph(graph, _InPlaceWrites).found)


class _InPlaceWrites:
    """Whether any op of a graph writes an input in place, as Grappler tells
    (its op type says "inplace", or an `in_place` / `inplace` attribute is
    set), or reads a reference."""

    def __init__(self, graph: tf.Graph):
        self.found = False
        self.add_ops(graph.get_operations())

    def add_ops(self, ops: list) -> None:
        self.found = self.found or any(map(_writes_in_place, ops))


def _writes_in_place(op: tf.Operation) -> bool:
    if op.type in _VARIABLE_WRITES:
        return False
    attrs = op.node_def.attr
    return ("inplace" in op.type.lower()
            or any(name in attrs and attrs[name].b for name in ("in_place", "inplace"))
            or any(compat.is_ref_dtype(t.dtype) for t in op.inputs))
