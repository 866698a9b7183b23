"""Reducing a gradient's full-size product before its sibling allocates.

The gradient of a broadcasting product `z = a * b` (a scale, a layer norm's
or a batch norm's gamma, the batch norm's `x * inv`) is two products of the
incoming gradient made by one gradient function: `grad * b` for `a`, full
size, and `a * grad` for `b`, also full size but summed at once to `b`'s
small shape. Nothing orders the two, so the executor may run both products
before the sum: one full-size buffer more at that moment. At MobileNetV2's
largest batch (64 px, 144, `"memory"`) that was the step's peak: the
recomputed block_1_expand batch norm's gradient held the input, the incoming
gradient, both products and the accumulator of the input's partial
gradients, five [144,32,32,96] buffers (docs/benchmarks_main.md).

Here the large outputs of a gradient function's other ops wait for such a
sum (the op reducing a full-size temporary that only it reads to a tensor at
most an eighth of its size), so the temporary is freed before they allocate.
Such an edge runs from a later-made op to an earlier one; it is added only
when the earlier op does not already lead to the later one (so no cycle), and
every other edge of the rewrite runs from an earlier op to a later one.
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat

_REDUCTIONS = frozenset({"Sum", "Mean"})
_SHRINK = 8  # a sum counts when its output is at most 1/_SHRINK of its input


def reductions_first(new_ops: list) -> int:
    """Makes the large ops of each gradient function wait for its sums.

    `new_ops`: the ops one tf.gradients call made, in creation order (it
    names a gradient function's ops under one scope, `<op>_grad/`).
    Returns how many control inputs were added.
    """
    by_scope = {}
    for op in new_ops:
        by_scope.setdefault(_scope(op), []).append(op)
    added = 0
    for op in new_ops:
        temporary = _reduced_temporary(op)
        if temporary is None:
            continue
        scope = by_scope[_scope(op)]
        for sibling in scope:
            if _should_wait(sibling, op, temporary) and not _leads_to(sibling, op, scope):
                compat.add_control_input(sibling, op)
                added += 1
    return added


def _scope(op: tf.Operation) -> str:
    return op.name.rpartition("/")[0]


def _reduced_temporary(op: tf.Operation):
    """The full-size tensor `op` sums, if only `op` reads it and `op` shrinks it."""
    if op.type not in _REDUCTIONS or not op.inputs:
        return None
    temporary = op.inputs[0]
    if len(temporary.consumers()) != 1 or _scope(temporary.op) != _scope(op):
        return None
    return temporary if _larger(temporary, op.outputs[0], _SHRINK) else None


def _should_wait(sibling: tf.Operation, reduction: tf.Operation, temporary: tf.Tensor) -> bool:
    """True for another op of the gradient function allocating about as much as
    `temporary`, not yet waiting for `reduction`."""
    if sibling in (reduction, temporary.op) or reduction in sibling.control_inputs:
        return False
    return any(not _larger(temporary, out, 2) for out in sibling.outputs)


def _larger(big: tf.Tensor, small: tf.Tensor, factor: int) -> bool:
    """True when `big` holds at least `factor` times the elements of `small`.

    Unknown dimensions (a batch of None) count alike on both sides: a tensor
    with more of them is the larger; with as many, the known ones decide.
    """
    (big_known, big_unknown), (small_known, small_unknown) = _size(big), _size(small)
    if big_unknown is None or small_unknown is None:  # unknown rank
        return False
    if big_unknown != small_unknown:
        return big_unknown > small_unknown
    return big_known >= factor * small_known


def _size(tensor: tf.Tensor):
    """(product of the known dimensions, count of unknown ones), (0, None) for an
    unknown rank."""
    if tensor.shape.rank is None:
        return 0, None
    known, unknown = 1, 0
    for dim in tensor.shape:
        if dim is None:
            unknown += 1
        else:
            known *= dim
    return known, unknown


def _leads_to(start: tf.Operation, goal: tf.Operation, scope: list) -> bool:
    """True when a data or control path within `scope` runs from `start` to `goal`.

    A path leaving a gradient function's ops reaches ops made after them and
    cannot come back: only the edges added here run backwards, each within one
    gradient function.
    """
    members = set(scope)
    following = {op: [] for op in scope}
    for op in scope:
        for before in list(op.control_inputs) + [t.op for t in op.inputs]:
            if before in members:
                following[before].append(op)
    seen, todo = {start}, [start]
    while todo:
        op = todo.pop()
        if op is goal:
            return True
        for nxt in following[op]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False
