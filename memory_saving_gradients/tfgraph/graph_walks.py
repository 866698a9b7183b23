"""Walks over a TensorFlow graph's data edges."""

from __future__ import annotations

from typing import Callable, Iterable, Optional


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


def tensors_feeding(tensors: Iterable, through: Callable,
                    inputs: Callable = lambda op: op.inputs) -> set:
    """ids of `tensors` and of the tensors they are computed from, walking
    from a tensor to its op's `inputs(op)` (all of them unless given) only
    where `through(tensor)` holds. Linear in the tensors reached and their
    ops' edges: an op's inputs are taken (and `inputs` asked) once, however
    many of its outputs are reached.

    Example: for x -> a -> y, tensors_feeding([y], lambda t: True) holds the
    ids of y, a's output and x; with `through=lambda t: t is not y`, only y's.
    """
    found, expanded, todo = set(), set(), list(tensors)
    while todo:
        tensor = todo.pop()
        if id(tensor) in found:
            continue
        found.add(id(tensor))
        if tensor.op not in expanded and through(tensor):
            expanded.add(tensor.op)
            todo.extend(inputs(tensor.op))
    return found
