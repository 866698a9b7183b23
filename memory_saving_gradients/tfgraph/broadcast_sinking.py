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

Where the shapes are static, only where they prove it: each op's result
shape the one it had. Where a dimension is unknown when traced (the batch of
a dataset batched without drop_remainder: TensorFlow then broadcasts with
`BroadcastTo(g, tf.shape(x))`), each op made on the small tensor is
broadcast back at run time to the shape the op it replaces had (the
broadcast of the full shape and its own): the same elements, and where it
is that shape already, as where the other operand is full-size, the kernel
passes its input on (no copy). A broadcast read by anything else (a
reduction, a loop, a returned gradient) is left as it is. Forward ops are
never touched: only ops that call made.
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
        small, full_shape = _broadcast_source(op)
        if small is not None and _sinkable(op.outputs[0], small.shape, run,
                                           dynamic=full_shape is not None):
            run.apply(op.outputs[0], small, full_shape)
    swapped = [run.latest(g) if isinstance(g, tf.Tensor) else g for g in gradients]
    return swapped, [placed for op in new_ops for placed in run.in_place_of(op)]


def keeps_small(op: tf.Operation, on_path: Callable[[tf.Operation], bool]) -> bool:
    """True when the rewrite's gradient of `op` to its input stays `op`'s
    output's size (the planner's view of `sink`, before any gradient exists).

    A Mean or Sum with static axes, at least 8 times smaller than its input
    (unknown dimensions as the planner assumes them), whose gradient (a Tile,
    or a BroadcastTo where a shape is not fully known) is read by what `sink`
    handles: the sum of the
    input's gradients (an input other ops on the way to the ys read too:
    `on_path`), or the gradient of the element-wise op that made the input (a
    batch norm's squared difference).
    """
    if op.type not in ("Mean", "Sum") or not op.inputs:
        return False
    source = op.inputs[0]
    if (source.shape.rank is None or op.outputs[0].shape.rank is None
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
    """(the small tensor `op` only broadcasts, the full shape as a tensor or
    None where it is static): a Tile along its unit dimensions with static
    shapes, or a BroadcastTo (with unknown dimensions too); else (None, None)."""
    if op.type not in ("Tile", "BroadcastTo") or len(op.outputs) != 1:
        return None, None
    small, full = op.inputs[0], op.outputs[0]
    if small.shape.rank is None or small.shape.rank != full.shape.rank:
        return None, None
    static = full.shape.is_fully_defined() and small.shape.is_fully_defined()
    if op.type == "Tile":
        multiples = tf.get_static_value(op.inputs[1])
        if not static or multiples is None or any(
                m != 1 and d != 1 for m, d in zip(multiples.tolist(), small.shape.as_list())):
            return None, None  # repeats a dimension larger than one: not a broadcast
    if not op_kinds.much_larger(full, small):
        return None, None
    return small, (None if static else op.inputs[1])


def _sinkable(full: tf.Tensor, small_shape: tf.TensorShape, run: "_Sinking",
              dynamic: bool) -> bool:
    """True when every reader of `full` (the broadcast of a tensor of
    `small_shape`), and on down the chain of ops that stay small, can take it
    small: readers made by the same call (`run.made`), of the kinds above,
    the result shape unchanged where it becomes full-size; none returned.
    `dynamic`: the broadcast's shape is a tensor, which `apply` broadcasts
    each result back to, so static shapes need only match where known;
    else static shapes prove each step."""
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
            if not _sinkable(reader.outputs[0], small_shape, run, dynamic):
                return False
            continue
        if reader.type not in _BINARY:
            return False
        shape = _result_shape(reader, full, small_shape)
        result = reader.outputs[0].shape
        if shape is None or result.rank is None:
            return False
        if shape.as_list() == result.as_list():
            if dynamic or result.is_fully_defined():
                continue  # the other operand has the full shape: broadcasts itself
            return False
        if (not (dynamic or shape.is_fully_defined())
                or _broadcast(shape, result) != result.as_list()
                or not _sinkable(reader.outputs[0], shape, run, dynamic)):
            return False
    return True


def _result_shape(reader: tf.Operation, full: tf.Tensor, small_shape: tf.TensorShape):
    """Static shape of binary `reader` with `full` read as a tensor of
    `small_shape` (unknown dimensions where an operand's are), or None where
    an operand's rank is unknown or the shapes cannot broadcast."""
    shapes = [small_shape if t is full else t.shape for t in reader.inputs]
    if any(s.rank is None for s in shapes):
        return None
    dims = _broadcast(*shapes)
    return None if dims is None else tf.TensorShape(dims)


def _broadcast(a, b):
    """The static broadcast of two shapes of known rank as a list, or None."""
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

    def apply(self, full: tf.Tensor, small: tf.Tensor, full_shape) -> None:
        """Makes the readers of `full` (the broadcast of `small`) read `small`.
        `full_shape`: `full`'s shape as a tensor where it is not static, else None."""
        for reader in list(full.consumers()):
            if reader in self.unread:
                continue
            with _beside(reader):
                if reader.type == "AddN":  # its terms have one shape: the sum has it
                    rest = [t for t in reader.inputs if t is not full]
                    total = (rest[0] if len(rest) == 1
                             else self._made(reader, tf.raw_ops.AddN(inputs=rest)))
                    new = self._made(reader, tf.raw_ops.AddV2(x=total, y=small))
                elif reader.type in _UNARY:
                    new = self._made(reader, getattr(tf.raw_ops, reader.type)(x=small))
                else:
                    x, y = (small if t is full else t for t in reader.inputs)
                    new = self._made(reader, getattr(tf.raw_ops, reader.type)(x=x, y=y))
                full_now = new.shape.as_list() == reader.outputs[0].shape.as_list()
                if full_now and full_shape is not None:  # unknown dimensions match anything
                    new = self._to_shape_of(reader, new, full_shape)
                elif not full_now and full_shape is not None:  # the reader's result shape
                    next_shape = self._shape_with(reader, full_shape, new)
            if full_now:
                self._replace(reader.outputs[0], new)
            else:  # still small: on to its readers
                self.apply(reader.outputs[0], new, None if full_shape is None else next_shape)
            self._leave(reader, new.op)
        self._leave(full.op, small.op)

    def _to_shape_of(self, reader: tf.Operation, new: tf.Tensor, full_shape) -> tf.Tensor:
        """`new` (`reader` made on the small tensor, and so recorded) broadcast
        to the shape `reader`'s result had: that of its operands, the full one
        given by `full_shape`. Static shapes cannot show the two the same where
        dimensions are unknown (a negated small tensor of shape (None, None)
        looks full-size beside (None, None)); where they are the same at run
        time (the other operand full-size, an AddN's sum), BroadcastTo passes
        its input on (no copy)."""
        broadcast = self._made(reader, tf.raw_ops.BroadcastTo(
            input=new, shape=self._shape_with(reader, full_shape, new)))
        broadcast.set_shape(reader.outputs[0].shape)
        return broadcast

    def _shape_with(self, reader: tf.Operation, full_shape, new: tf.Tensor) -> tf.Tensor:
        """The shape `reader`'s result had, as a tensor: the broadcast of
        `full_shape` and `new`'s (`reader` made on the small tensor)."""
        return self._made(reader, tf.raw_ops.BroadcastArgs(
            s0=full_shape, s1=self._made(reader, tf.shape(new, out_type=full_shape.dtype))))

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
