"""Keeping Grappler's constant push-down from moving gradient work into the forward pass.

Grappler's constant folding rewrites `op(C, op(X, Y))`, C constant and op an
addition or a product (or their inverses), into `op(X, op(C, Y))`, pairing C
with the inner op's second operand. In a gradient that operand is often a
forward tensor: Keras' hard swish `x * (relu6(x + 3) / 6)` differentiates into
`(g * x) / 6`, a product by the reciprocal once folded, rewritten
`g * (x * (1 / 6))`. The product of the constant and the forward tensor depends
on no gradient, so the executor runs it in the forward pass and holds the
result until backprop reaches it: one tensor of x's size per hard swish, alive
across the step (MobileNetV3Small at 64 px, `"memory"`: 11 such products at the
measured peak, the stem's 0.5 MiB among them, outside the plan's levels).

`pin(ops)` makes each such constant depend on the inner op's result (the
constant plus a zero no optimizer folds, `gradient_waits.seed_after_gate`):
no longer constant, it is not pushed down, and the gradient is computed in the
order TensorFlow wrote it, after the gradient it scales. That order rounds as
the eager tape does, not as the rotated form: in float16, `g * x` can
overflow where `g * (x * (1 / 6))` did not. Under XLA, which orders and
fuses the step itself, nothing is pinned: there the rotation moves nothing
into the forward pass, and pinning changed float16 gradients that matched
stock's bit for bit (a large `g` made them infinite).
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import gradient_waits

# The families Grappler's ConstantPushDown rotates within: a sum or difference
# of a sum or difference, a product or quotient of a product or quotient.
_FAMILIES = (frozenset({"Add", "AddV2", "Sub"}), frozenset({"Mul", "RealDiv", "Div"}))


def pushed_down(ops: list) -> list:
    """(op, index) of each op of `ops` (one tf.gradients call's) whose input
    `index` is a constant Grappler would push into the op's other operand: an
    op of `ops` of the same family that reads a tensor made outside `ops`
    (a forward tensor, which the constant's product would then run beside)."""
    made = set(ops)
    sites = []
    for op in ops:
        family = _family(op.type)
        if family is None or len(op.inputs) != 2:
            continue
        for index in (0, 1):
            constant, inner = op.inputs[index], op.inputs[1 - index].op
            if (_is_constant(constant) and _scalable(constant.dtype)
                    and inner in made and inner.type in family
                    and any(t.op not in made and not _is_constant(t) for t in inner.inputs)):
                sites.append((op, index))
                break
    return sites


def pin(ops: list) -> list:
    """Makes each constant of `pushed_down(ops)` wait for the operand it
    scales, outside XLA. Returns `ops` with the ops that does so, each
    site's just before the op it feeds (the ordering passes after it take the
    list for an order of runs)."""
    sites = pushed_down(ops)
    if not sites or compat.in_xla_context(sites[0][0].graph):
        return ops
    graph = sites[0][0].graph
    first = len(graph.get_operations())
    pinned = {}
    for op, index in sites:
        with graph.as_default(), tf.name_scope(op.name + "_pinned"):
            constant = gradient_waits.seed_after_gate(
                op.inputs[index], gradient_waits.gate([op.inputs[1 - index]]))
        compat.replace_input(op, index, constant)
        pinned[op] = constant.op
    position = {new: i for i, new in enumerate(graph.get_operations()[first:])}
    placed = {}
    for op, last in pinned.items():  # a walk over one site's few ops each
        group, todo = set(), [last]
        while todo:
            new = todo.pop()
            if new in position and new not in group:
                group.add(new)
                todo.extend(gradient_waits.runs_after(new))
        placed[op] = sorted(group, key=position.__getitem__)
    return [new for op in ops for new in placed.get(op, []) + [op]]


def _family(op_type: str):
    return next((family for family in _FAMILIES if op_type in family), None)


def _scalable(dtype: tf.DType) -> bool:
    """Dtypes a pinned constant is made in: the push-down rotates quotients
    and differences only of these, and a gate adds its zero to them."""
    return dtype.is_floating or dtype.is_complex


def _is_constant(tensor: tf.Tensor) -> bool:
    return tensor.op.type in ("Const", "HostConst")
