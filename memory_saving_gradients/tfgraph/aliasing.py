"""Which resource handles of a graph may point to the same variable.

Handles are grouped with a union-find: what an op's resource outputs point
to may be any of its resource inputs (Identity, calls, If, While, Switch,
Enter...); VarHandleOps with one shared name are one variable; any two
resource arguments of a tf.function may be the same variable.
"""

from __future__ import annotations

import networkx as nx
import tensorflow as tf


def resources(tensors) -> list:
    """The resource tensors (variable handles) among `tensors`."""
    return [t for t in tensors if t.dtype == tf.resource]


class HandleGroups:
    """Union-find over the names of a graph's resource tensors, kept up to date."""

    def __init__(self, graph: tf.Graph):
        self._groups = nx.utils.UnionFind()
        self._by_shared_name = {}  # (container, shared name) -> a handle name
        self._argument = None  # a handle name of a tf.function resource argument
        self._captured = {id(t) for t in getattr(graph, "internal_captures", ())}
        self.add_ops(graph.get_operations())

    def group(self, handle_name: str) -> str:
        """A name that stands for every handle that may alias `handle_name`."""
        return self._groups[handle_name]

    def add_ops(self, ops: list) -> None:
        """Joins the handles `ops` make with those they may point to. Linear."""
        for op in ops:
            outputs = [t.name for t in resources(op.outputs)]
            if not outputs:
                continue
            if op.type == "VarHandleOp":
                key = (op.get_attr("container"), op.get_attr("shared_name") or op.name)
                self._groups.union(*outputs, self._by_shared_name.setdefault(key, outputs[0]))
            elif op.type == "Placeholder":
                if id(op.outputs[0]) not in self._captured:
                    self._argument = self._argument or outputs[0]
                    self._groups.union(*outputs, self._argument)
            else:
                self._groups.union(*outputs, *(t.name for t in resources(op.inputs)))
