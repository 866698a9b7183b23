"""The ledger of partial gradients that backprop collects level by level.

Each tensor's gradient arrives in parts, one per `tf.gradients` call that
reaches it. A part is either still to be sent through the tensor's op, or
was sent through it already (tf.gradients differentiates function calls even
at stop_gradients): sent parts count in the tensor's full gradient but must
never be sent again.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import gradient_waits

Gradient = "tf.Tensor | tf.IndexedSlices"


@dataclasses.dataclass(frozen=True)
class Settled:
    """A tensor's gradient once every part has arrived.

    Attributes:
      total: the full gradient (every part), None if nothing arrived.
      unsent: the parts still to send through the tensor's op, summed; None
        if every part was sent already.
    """
    total: Optional[Gradient]
    unsent: Optional[Gradient]


def add_up(parts: list, made_after: Optional[int] = None) -> Optional[Gradient]:
    """Sums partial gradients; IndexedSlices stay sparse when all parts are.

    tf.gradients takes IndexedSlices as grad_ys, so sparse gradients (from
    gathers, embeddings) reach the xs sparse, as with tf.gradients.
    `made_after` (a graph version): dense parts are added as they are made,
    ordering the ops made after it (`_sum_as_made`).
    """
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, tf.IndexedSlices) for p in parts):
        index_dtype = tf.int64 if any(p.indices.dtype == tf.int64 for p in parts) else tf.int32
        return tf.IndexedSlices(
            tf.concat([p.values for p in parts], axis=0),
            tf.concat([tf.cast(p.indices, index_dtype) for p in parts], axis=0),
            parts[0].dense_shape)
    if made_after is not None:
        return _sum_as_made(parts, made_after)
    return _running_sum([tf.convert_to_tensor(p) for p in parts])


def _sum_as_made(parts: list, made_after: int) -> tf.Tensor:
    """`_running_sum` of `parts` in their ops' creation order, each sum a
    control input of the op making the next part: the executor adds each part
    as it comes, one running sum alive rather than every part (stock holds a
    block applied 8 times as 8 weight gradients), and the control edges keep
    Grappler's arithmetic optimizer from folding the chain into one AddN (it
    leaves nodes with control dependencies alone).

    Only ops made after graph version `made_after` (the rewrite's) are made to
    wait, and none the sum already waits for: that edge would close a cycle
    (two parts of one op, or an ordering edge of the rewrite running against
    creation). A path from such an op to the sum runs through the rewrite's
    ops alone, so the sum's ancestors among them, grown as the chain is,
    tell: each op is walked once per sum, not once per part."""
    makers = {id(p): gradient_waits.gradient_values(p).op for p in parts}
    ordered = sorted(parts, key=lambda p: compat.creation_id(makers[id(p)]))
    waited_for = set()

    def made_by_the_rewrite(op):
        return compat.creation_id(op) > made_after

    total = tf.convert_to_tensor(ordered[0])
    for part, following in zip(ordered[1:], ordered[2:] + [None]):
        total = tf.add_n([total, tf.convert_to_tensor(part)])
        gradient_waits.add_ancestors(waited_for, [total.op], made_by_the_rewrite)
        maker = None if following is None else makers[id(following)]
        if maker is not None and maker not in waited_for and made_by_the_rewrite(maker):
            compat.add_control_input(maker, total.op)
    return total


def _running_sum(parts: list) -> tf.Tensor:
    """`parts` added one at a time, in the order they were made.

    The parts of a tensor's gradient come from levels run one after another,
    so each addition runs as soon as the next part exists, and into the
    running sum's buffer. A single AddN of parts made at different times is
    rewritten by Grappler's memory optimizer into an accumulator allocated as
    soon as the first part exists, one full-size buffer beside it: on
    MobileNetV2 (64 px, batch 144, `"memory"`) a batch norm's input gradient
    from three levels held it at the step's peak (docs/benchmarks_main.md).
    That rewrite skips AddN of two inputs, so each addition is one: AddN's
    rules, as tf.gradients sums, for every dtype (variant TensorList parts
    included), never broadcasting (a part of shape [1, n] beside [batch, n],
    from a wrong-shaped custom gradient, broadcast with tf.math.add). Grappler's
    arithmetic optimizer may still fold a chain of them, each sum read by the next
    alone, back into one AddN: it did for the parts of a weight's 8 reads
    (docs/planner.md, session 78), which `_sum_as_made` now adds.
    """
    total = parts[0]
    for part in parts[1:]:
        total = tf.add_n([total, part])
    return total


class GradientLedger:
    """Partial gradients per tensor name: add them, then settle or take them."""

    def __init__(self, made_after: Optional[int] = None):
        """`made_after`: the graph's version before the ledger's gradients were
        made; the ops made after it may be ordered (`move`)."""
        self._unsent = {}  # name -> parts still to send through its op
        self._sent = {}  # name -> parts already sent through its op
        self._as_made = set()  # names whose parts are added as they are made (`move`)
        self._made_after = made_after

    def add(self, name: str, gradient: Gradient, sent: bool = False) -> None:
        (self._sent if sent else self._unsent).setdefault(name, []).append(gradient)

    def move(self, name: str, to: str) -> None:
        """`name`'s unsent parts become parts of `to`'s, and `to`'s parts are
        added up as they are made (`add_up`'s `made_after`)."""
        assert self._made_after is not None, "a ledger that orders no ops adds parts as stock"
        self._unsent.setdefault(to, []).extend(self._unsent.pop(name, []))
        self._as_made.add(to)

    def settle(self, name: str) -> Settled:
        """Removes `name`'s parts; returns its full gradient and its unsent part."""
        unsent, sent = self._unsent.pop(name, []), self._sent.pop(name, [])
        total = add_up(unsent + sent, self._made_after_for(name))
        return Settled(total=total, unsent=add_up(unsent) if sent else total)

    def take_unsent(self, name: str) -> Optional[Gradient]:
        """Removes and sums the parts of `name` still to send."""
        return add_up(self._unsent.pop(name, []))

    def unsent_names(self) -> list:
        return list(self._unsent)

    def total(self, name: str) -> Optional[Gradient]:
        """The sum of every part of `name` so far, leaving them in place."""
        return add_up(self._unsent.get(name, []) + self._sent.get(name, []),
                      self._made_after_for(name))

    def _made_after_for(self, name: str) -> Optional[int]:
        return self._made_after if name in self._as_made else None
