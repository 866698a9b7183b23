"""Whole-graph scans done once per graph, then kept up to date op by op.

Several `gradients` calls on one graph (a GAN step, the tape's persistent
calls, second-order gradients) read the same facts about it. Each call adds
ops, so instead of scanning again, a scan is told only of the ops added since
it last looked: two calls on one graph cost one scan plus the new ops.

A scan is a class built from a graph's ops whose `add_ops(ops)` takes ops
created later, in creation order.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol, TypeVar

import tensorflow as tf


class GraphScan(Protocol):
    def __init__(self, graph: tf.Graph) -> None: ...

    def add_ops(self, ops: list) -> None: ...


S = TypeVar("S", bound=GraphScan)

# graph -> {scan class: [scan, number of ops it has seen]}
_scans: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # replicas of a tf.distribute strategy trace in threads


def per_graph(graph: tf.Graph, kind: type[S]) -> S:
    """The `kind` scan of `graph`, brought up to date. O(new ops) after the first."""
    ops = graph.get_operations()
    with _lock:
        entries = _scans.setdefault(graph, {})
        if kind not in entries:
            entries[kind] = [kind(graph), len(ops)]
        else:
            scan, seen = entries[kind]
            if seen < len(ops):
                scan.add_ops(ops[seen:])
                entries[kind][1] = len(ops)
        return entries[kind][0]
