"""Gradients of means and sums reach their input by broadcasting, not as a full-size Tile.

TensorFlow differentiates `m = reduce_mean(x, axes, keepdims=True)` (a batch
norm's moments, a layer norm's, any mean or sum with static shapes) into
`Tile(reshape(grad), multiples) / n`: the per-channel gradient copied out to
x's full shape. That copy is then only divided, multiplied and added into x's
gradient by AddN, which cannot broadcast, so it is a full-size buffer made
only to be read once. At the CIFAR ResNet's largest batch (409, `"memory"`)
two of the nine full-size buffers alive at the peak were these copies, block
0's `moments/mean_grad/Tile` and `moments/variance_grad/Tile`
(benchmarks/results/max_batch_s24_peaks.md).

`sink(new_ops, gradients)` takes the ops one tf.gradients call made and moves
each such broadcast past its element-wise readers: an op on the broadcast
and tensors that keep it small (`/ n`, `2 *`) is made on the small tensor
instead; an op whose other operand has the full shape (`* (x - mean)`) reads
the small tensor and broadcasts itself; an AddN term is added by a
broadcasting AddV2 to the AddN of the other terms. Each replacement computes
the same elements as the op it replaces (only the AddN's order of addition
changes: float rounding), its readers and waiters are moved to it, and the
replaced ops are left unread (the executor never runs them).

Only where static shapes prove it: the broadcast's and every operand's shape
fully known, and each op's result shape the one it had. A broadcast read by
anything else (a reduction, a loop, a returned gradient) is left as it is.
Forward ops are never touched: only ops that call made.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph.gradient_waits import gradient_tensors

# Element-wise ops with broadcasting, inputs (x, y); op(broadcast(u), v) has
# the elements of broadcast(op(u, v)).
_BINARY = frozenset({"Mul", "RealDiv", "AddV2", "Sub", "DivNoNan", "MulNoNan",
                     "SquaredDifference", "Maximum", "Minimum"})
_UNARY = frozenset({"Neg"})
# Of those, the ones whose gradient multiplies the incoming gradient by an operand.
_SCALING = frozenset({"Mul", "RealDiv", "DivNoNan", "MulNoNan"})


def sink(new_ops: list, gradients: list) -> tuple:
    """Moves the large broadcasts of small tensors among `new_ops` into their readers.

    `new_ops`: the ops one tf.gradients call made, in creation order;
    `gradients`: what it returned. Returns (`gradients` with each replaced
    tensor swapped for its replacement, the call's ops without those left
    unread and with the replacements, each where the op it replaces was:
    the ordering passes after it take creation order for an order of runs).
    """
    run = _Sinking(set(new_ops), {t.ref() for g in gradients if g is not None
                                  for t in gradient_tensors(g)})
    for op in new_ops:
        if op in run.unread:
            continue
        small = _broadcast_source(op)
        if small is not None and _sinkable(op.outputs[0], small.shape, run):
            run.apply(op.outputs[0], small)
    swapped = [run.latest(g) if isinstance(g, tf.Tensor) else g for g in gradients]
    return swapped, [placed for op in new_ops for placed in run.in_place_of(op)]


def keeps_small(op: tf.Operation, on_path: Callable[[tf.Operation], bool]) -> bool:
    """True when the rewrite's gradient of `op` to its input stays `op`'s
    output's size (the planner's view of `sink`, before any gradient exists).

    A Mean or Sum with static shapes, at least 8 times smaller than its input,
    whose gradient (a Tile) is read by what `sink` handles: the sum of the
    input's gradients (an input other ops on the way to the ys read too:
    `on_path`), or the gradient of the element-wise op that made the input (a
    batch norm's squared difference).
    """
    if op.type not in ("Mean", "Sum") or not op.inputs:
        return False
    source = op.inputs[0]
    if (not source.shape.is_fully_defined() or not op.outputs[0].shape.is_fully_defined()
            or tf.get_static_value(op.inputs[1]) is None):
        return False
    if not op_kinds.much_larger(source, op.outputs[0]):
        return False
    if sum(map(on_path, source.consumers())) > 1:
        return True  # its gradient is a term of an AddN
    # A product or quotient of full-size operands (a squared difference's
    # second may be small) multiplies the broadcast by a full-size tensor;
    # a sum's or a select's gradient passes it on to ops `sink` leaves alone.
    made_by = source.op
    return made_by.type == "SquaredDifference" or (
        made_by.type in _SCALING
        and all(t.shape.as_list() == source.shape.as_list() for t in made_by.inputs))


def _broadcast_source(op: tf.Operation):
    """The small tensor `op` only broadcasts (a Tile along its unit dimensions,
    or a BroadcastTo), when both shapes are static; else None."""
    if op.type not in ("Tile", "BroadcastTo") or len(op.outputs) != 1:
        return None
    small, full = op.inputs[0], op.outputs[0]
    if not (small.shape.is_fully_defined() and full.shape.is_fully_defined()
            and small.shape.rank == full.shape.rank):
        return None
    if op.type == "Tile":
        multiples = tf.get_static_value(op.inputs[1])
        if multiples is None or any(m != 1 and d != 1 for m, d in
                                    zip(multiples.tolist(), small.shape.as_list())):
            return None  # repeats a dimension larger than one: not a broadcast
    if not op_kinds.much_larger(full, small):
        return None
    return small


def _sinkable(full: tf.Tensor, small_shape: tf.TensorShape, run: "_Sinking") -> bool:
    """True when every reader of `full` (the broadcast of a tensor of
    `small_shape`), and on down the chain of ops that stay small, can take it
    small: readers made by the same call (`run.made`), of the kinds above,
    with static shapes, the result shape unchanged where it becomes full-size;
    none returned."""
    if full.ref() in run.returned:
        return False
    for reader in full.consumers():
        if reader not in run.made:
            return False
        if reader.type == "AddN":
            if sum(t is full for t in reader.inputs) != 1:
                return False  # no full-size term to add it to, or it twice
            continue
        if reader.type in _UNARY:
            if not _sinkable(reader.outputs[0], small_shape, run):
                return False
            continue
        if reader.type not in _BINARY:
            return False
        shape = _result_shape(reader, full, small_shape)
        result = reader.outputs[0].shape
        if shape is None or not result.is_fully_defined():
            return False
        if shape.as_list() == result.as_list():
            continue  # the other operand has the full shape: broadcasts itself
        if (_broadcast(shape, result) != result.as_list()
                or not _sinkable(reader.outputs[0], shape, run)):
            return False
    return True


def _result_shape(reader: tf.Operation, full: tf.Tensor, small_shape: tf.TensorShape):
    """Static shape of binary `reader` with `full` read as a tensor of
    `small_shape`, or None where an operand's shape is not fully known."""
    shapes = [small_shape if t is full else t.shape for t in reader.inputs]
    if not all(s.is_fully_defined() for s in shapes):
        return None
    dims = _broadcast(*shapes)
    return None if dims is None else tf.TensorShape(dims)


def _broadcast(a, b):
    """The broadcast of two fully known shapes as a list, or None."""
    try:
        return tf.broadcast_static_shape(tf.TensorShape(a), tf.TensorShape(b)).as_list()
    except ValueError:
        return None


class _Sinking:
    """The replacements made so far in one call's ops."""

    def __init__(self, made: set, returned: set):
        self.made = made          # grows with the ops made here, which later broadcasts may read
        self.returned = returned  # refs of the tensors the call returned
        self.replaced = {}        # ref of a full-size tensor -> the tensor now read instead
        self.unread = set()
        self.placed = {}          # op left unread -> the ops made to stand for it

    def apply(self, full: tf.Tensor, small: tf.Tensor) -> None:
        """Makes the readers of `full` (the broadcast of `small`) read `small`."""
        for reader in list(full.consumers()):
            if reader in self.unread:
                continue
            with _beside(reader):
                if reader.type == "AddN":
                    rest = [t for t in reader.inputs if t is not full]
                    total = (rest[0] if len(rest) == 1
                             else self._made(reader, tf.raw_ops.AddN(inputs=rest)))
                    new = tf.raw_ops.AddV2(x=total, y=small)
                elif reader.type in _UNARY:
                    new = getattr(tf.raw_ops, reader.type)(x=small)
                else:
                    x, y = (small if t is full else t for t in reader.inputs)
                    new = getattr(tf.raw_ops, reader.type)(x=x, y=y)
            self._made(reader, new)
            if new.shape.as_list() == reader.outputs[0].shape.as_list():
                self._replace(reader.outputs[0], new)
            else:  # still small: on to its readers
                self.apply(reader.outputs[0], new)
            self._leave(reader, new.op)
        self._leave(full.op, small.op)

    def latest(self, t: tf.Tensor) -> tf.Tensor:
        """What stands for `t` now: a replacement may itself be replaced (an
        AddN of two broadcasts becomes AddV2(broadcast, small), then AddV2(small, small))."""
        while t.ref() in self.replaced:
            t = self.replaced[t.ref()]
        return t

    def in_place_of(self, op: tf.Operation) -> list:
        """`op` if it is still read, after the ops made to stand for it (and
        for those, recursively): in an order the ops' inputs allow."""
        ops = [made for placed in self.placed.get(op, []) for made in self.in_place_of(placed)]
        return ops + ([op] if op not in self.unread else [])

    def _replace(self, old: tf.Tensor, new: tf.Tensor) -> None:
        """The readers of `old` read `new` (same shape and elements) instead."""
        for reader in list(old.consumers()):
            for index, t in enumerate(reader.inputs):
                if t is old:
                    compat.replace_input(reader, index, new)
        self.replaced[old.ref()] = new

    def _leave(self, op: tf.Operation, successor: tf.Operation) -> None:
        """Ops that waited for `op` wait for `successor`; `op` is left unread."""
        for waiter in list(compat.control_outputs(op)):
            compat.replace_control_input(waiter, op, successor)
        self.unread.add(op)

    def _made(self, replaced: tf.Operation, t: tf.Tensor) -> tf.Tensor:
        """Records `t`'s op, made to stand for `replaced`."""
        self.made.add(t.op)
        self.placed.setdefault(replaced, []).append(t.op)
        return t


@contextlib.contextmanager
def _beside(op: tf.Operation):
    """Creates ops in `op`'s name scope, on its device."""
    scope = op.name.rpartition("/")[0]
    with op.graph.name_scope(scope + "/" if scope else None), op.graph.device(op.device):
        yield
