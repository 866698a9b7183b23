"""Which ops and graph functions have side effects beyond reading variables.

A function is judged by the ops in its FunctionDef, following the functions
it calls; results are memoised per graph (see `graph_cache`).
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import effects

# Stateful ops that only read a variable: rerunning them gives the same value
# as long as nothing assigns the variable in between.
READ_OP_TYPES = frozenset({"ReadVariableOp", "VariableShape", "VarIsInitializedOp"})


def find_function(graph: tf.Graph, name: str):
    """The graph function `name`, from `graph` or a graph enclosing it, or None."""
    while graph is not None:
        function = compat.graph_function(graph, name)
        if function is not None:
            return function
        graph = getattr(graph, "outer_graph", None)
    return None


def called_functions(node) -> list:
    """Names of the graph functions a NodeDef runs: by attr or as its op type."""
    names = [value.func.name for value in node.attr.values() if value.func.name]
    names += [f.name for value in node.attr.values() for f in value.list.func]
    if compat.op_def(node.op) is None:
        names.append(node.op)
    return names


def stateless_or_read(op_type: str) -> bool:
    """True if a registered op type reruns identically or only reads a variable."""
    return op_type in READ_OP_TYPES or effects.reruns_identically(compat.op_def(op_type))


def function_nodes(graph: tf.Graph, name: str):
    """The NodeDefs of graph function `name`, or None if it cannot be found."""
    function = find_function(graph, name)
    return None if function is None else function.cached_definition.node_def


class FunctionPurity:
    """Answers 'does function f only read?' for the functions of one graph."""

    def __init__(self, graph: tf.Graph):
        self._graph = graph
        self._memo = {}

    def only_reads(self, name: str, seen=None) -> bool:
        """True if function `name` and those it calls hold no stateful op but reads."""
        if name in self._memo:
            return self._memo[name]
        seen = set() if seen is None else seen
        if name in seen:
            return True  # recursion: judged by the rest of the call chain
        seen.add(name)
        nodes = function_nodes(self._graph, name)
        result = nodes is not None and all(self._node_only_reads(n, seen) for n in nodes)
        self._memo[name] = result
        return result

    def _node_only_reads(self, node, seen) -> bool:
        called = called_functions(node)
        if called:
            return all(self.only_reads(n, seen) for n in called)
        return stateless_or_read(node.op)
