"""Walks over a TensorFlow graph's data edges."""

from __future__ import annotations

from typing import Iterable, Optional


def ops_reading(tensors: Iterable, within: Optional[set] = None) -> set:
    """The ops that read `tensors`, directly or through other such ops; only
    ops in `within` when given (a walk that never leaves it). Linear in the
    ops reached and their edges.

    Example: for x -> a -> b, ops_reading([x]) == {a, b}; with within={a}, {a}.
    """
    found, todo = set(), list(tensors)
    while todo:
        for op in todo.pop().consumers():
            if op not in found and (within is None or op in within):
                found.add(op)
                todo.extend(op.outputs)
    return found
