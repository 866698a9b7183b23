"""A broadcasting product's two gradient products, one after the other.

tf.gradients differentiates `z = a * s` (`s` broadcast: a scale, a batch or
layer norm's `x * inv`) into `grad * s` for `a` and `sum(a * grad)` for `s`:
two full-size products of the same incoming gradient, one of them a
temporary that the sum shrinks at once. Nothing orders them, so the executor
may make both before the sum: one full-size buffer more, and a fresh one for
`grad * s` where it could have taken `grad`'s buffer as its last reader. At
MobileNetV2's largest batch (64 px, 140, `"memory"`) that moment was the
step's peak: the recomputed block_1_expand batch norm's input, its incoming
gradient and both products, four [140,32,32,96] buffers
(docs/benchmarks_main.md).

Here an element-wise gradient op that reads the same full-size tensor as
such a temporary's product, and is as large, waits for the sum. Only that
pair: a reduction of a contraction's batched temporary (a broadcast
BatchMatMul's weight gradient) and other ops of the gradient function are
left alone, as ordering them all cost a BERT encoder 30 MiB (ca2bed3).
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph.gradient_waits import ancestors_among
from memory_saving_gradients.tfgraph.gradient_waits import depends_on
from memory_saving_gradients.tfgraph.gradient_waits import gradient_tensors

_REDUCTIONS = frozenset({"Sum", "Mean"})


def sums_first(new_ops: list, gradients: list) -> int:
    """Makes each sibling product of a shrinking sum's temporary wait for the sum.

    `new_ops`: the ops one tf.gradients call made; `gradients`: what it
    returned. Only sums and siblings they need count: tf.gradients also
    makes the sum of an input nothing differentiates (a constant scale),
    which the executor skips, and an edge from it would make it run.
    Returns how many control inputs were added. An edge is added only where
    the sum does not depend on the sibling (no cycle), by a walk over the
    whole graph: on a BERT encoder a walk kept among `new_ops` missed a path
    and the step failed with a cycle.
    """
    among = set(new_ops)
    needed = ancestors_among(new_ops, [t for g in gradients for t in gradient_tensors(g)])
    added = 0
    for reduction in new_ops:
        product = _shrunk_product(reduction, among) if reduction in needed else None
        if product is None:
            continue
        for sibling in _siblings(product, needed):
            if reduction in sibling.control_inputs:
                continue
            if depends_on(reduction, sibling):
                continue
            compat.add_control_input(sibling, reduction)
            added += 1
    return added


def _shrunk_product(reduction: tf.Operation, among: set):
    """The element-wise op whose output only `reduction` reads and shrinks, or None."""
    if reduction.type not in _REDUCTIONS or not reduction.inputs:
        return None
    temporary = reduction.inputs[0]
    product = temporary.op
    if product not in among or product.type not in op_kinds.FORWARDING_OP_TYPES:
        return None
    if len(temporary.consumers()) != 1:
        return None
    return product if op_kinds.much_larger(temporary, reduction.outputs[0]) else None


def _siblings(product: tf.Operation, among: set) -> list:
    """The other element-wise ops of `among` (the needed ones) reading an input
    of `product` that is as large as its output, with an output as large again."""
    temporary = product.outputs[0]
    found = []
    for shared in product.inputs:
        if not _same_shape(shared, temporary):
            continue
        for reader in shared.consumers():
            if (reader is not product and reader in among and reader not in found
                    and reader.type in op_kinds.FORWARDING_OP_TYPES
                    and _same_shape(reader.outputs[0], shared)):
                found.append(reader)
    return found


def _same_shape(a: tf.Tensor, b: tf.Tensor) -> bool:
    return a.shape.rank is not None and a.shape.as_list() == b.shape.as_list()

