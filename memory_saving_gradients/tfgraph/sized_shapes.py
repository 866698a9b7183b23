"""The shapes the planner assumes where a graph leaves dimensions unknown.

A step traced on a dataset batched without drop_remainder (what Keras's `fit`
sees then) has an unknown batch dimension, and so does every activation.
Counted as 1 each, activations would weigh less beside weights and their
gradients than at any real batch size, and plans would follow the weights (a
BERT-like encoder's 'memory' plan kept 0.69 of tf.gradients' activations so,
0.30 with the batch known). So each unknown dimension of the step's inputs
counts as `UNKNOWN_DIM_SIZE`, and the shapes that follow from them are
TensorFlow's own: its shape functions run on a scratch copy of the graph's
ops made from inputs of those sizes. A dense layer's input reshaped to
batch x tokens rows (one unknown dimension in the graph) is 32 x tokens rows
there, not 32. A caller that knows the size (`budget(max_bytes, batch_size=n)`)
reads and rewrites a graph under `unknown_dims_as(n)` instead.

Ops whose copy TensorFlow cannot make or infer (function calls, control flow)
give outputs of their own static shapes with each unknown dimension at that
size, and so does every tensor for which the copy knows no more.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref

import tensorflow as tf

from memory_saving_gradients.core.model import UNKNOWN_DIM_SIZE
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import graph_cache

# Ops not copied: their copies would need the graph's functions, or read back
# edges (v1 loops); their outputs take `_assumed` shapes.
_NOT_COPIED = frozenset({
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "SymbolicGradient",
    "Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge", "Switch", "RefSwitch",
    "NextIteration", "RefNextIteration", "LoopCond"})


def sized_dims(t: tf.Tensor):
    """`t`'s dimensions with each unknown one as the planner assumes it
    (`assumed_size`); None for an unknown rank. Fully known shapes are
    returned as they are."""
    shape = t.shape
    if shape.rank is None:
        return None
    if shape.is_fully_defined():
        return shape.as_list()
    size = assumed_size()
    latest = _latest.setdefault(t.graph, {})
    copy = latest.get(size)
    if copy is None or not copy.knows(t):  # brought up to date only then: O(graph)
        copy = latest[size] = graph_cache.per_graph(t.graph, _sized_copy_kind(size))
    return copy.dims(t)


@contextlib.contextmanager
def unknown_dims_as(size: int):
    """Within (in this thread), each unknown dimension of a step's inputs
    counts as `size` instead of `UNKNOWN_DIM_SIZE`."""
    before = assumed_size()
    _assumed_here.size = size
    try:
        yield
    finally:
        _assumed_here.size = before


def assumed_size() -> int:
    """What an unknown dimension of a step's inputs counts as here and now."""
    return getattr(_assumed_here, "size", UNKNOWN_DIM_SIZE)


def growing_past_linear(tensors) -> list:
    """The tensors among `tensors` whose sizes grow faster than the size an
    unknown dimension counts as: sized with it doubled, more than twice the
    elements (two unknown dimensions of the step's inputs in their shapes, a
    batch and a sequence length, or an op's output of several unknown ones)."""
    def elements(dims):
        return 1 if dims is None else math.prod(dims)

    with unknown_dims_as(2 * assumed_size()):
        doubled = [elements(sized_dims(t)) for t in tensors]
    return [t for t, grown in zip(tensors, doubled) if grown > 2 * elements(sized_dims(t))]


# Per thread (tf.distribute's replicas trace in threads): `unknown_dims_as`'s size.
_assumed_here = threading.local()
# graph -> {assumed size: its SizedCopy as last brought up to date}, asked first.
_latest: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()
# assumed size -> the SizedCopy kind `graph_cache` keeps one scan of per graph.
_kinds: dict = {}


def _sized_copy_kind(size: int) -> type:
    if size not in _kinds:
        _kinds[size] = type(f"SizedCopy{size}", (SizedCopy,), {"size": size})
    return _kinds[size]


class SizedCopy:
    """The ops of a graph whose outputs have unknown dimensions, copied on a
    scratch graph from inputs of the sizes assumed (a `graph_cache` scan: ops
    added later are copied when asked about). Made only for a graph with a
    tensor of unknown dimensions whose size is asked.

    Float tensors stand in as placeholders of their shapes, shared by shape:
    only shapes matter to shape functions, and an op reading only those
    gives its outputs' shapes once per kind of op, attributes and input
    shapes (a thousand identical blocks: one copy). Integer tensors (a shape
    computed with `tf.shape`, constants) are copied op by op, as TensorFlow's
    shape functions read their values. Each unknown dimension of the step's
    inputs is `size` (one subclass per size: `_sized_copy_kind`)."""

    size = UNKNOWN_DIM_SIZE

    def __init__(self, graph: tf.Graph):
        self._scratch = tf.Graph()
        self._copies = {}   # original tensor name -> what stands for it
        self._shared = {}   # (dtype, dims) -> a placeholder of that shape
        self._inferred = {}  # `_kind` -> the output dims a copy of that kind inferred
        self.add_ops(graph.get_operations())

    def add_ops(self, ops: list) -> None:
        with self._scratch.as_default():
            for op in ops:
                if any(not o.shape.is_fully_defined() for o in op.outputs):
                    self._copy_with_inputs(op)

    def knows(self, t: tf.Tensor) -> bool:
        return t.name in self._copies

    def dims(self, t: tf.Tensor):
        """`sized_dims` of `t`, a tensor of the graph."""
        copy = self._copies.get(t.name)
        return self._assumed(copy.shape if copy is not None else t.shape)

    def _copy_with_inputs(self, op: tf.Operation) -> None:
        """Copies `op` after the inputs it needs copied (`_copied_input`),
        depth first without recursion (a chain of a thousand integer adds is
        a thousand deep). A cycle (a tf.compat.v1 loop's back edge) is cut
        where it closes: that input stands in as a placeholder."""
        stack, entered = [(op, False)], set()
        while stack:
            current, inputs_done = stack.pop()
            if self.knows(current.outputs[0]):
                continue
            if inputs_done or current.type in _NOT_COPIED:
                self._copy(current)
            elif current not in entered:
                entered.add(current)
                stack.append((current, True))
                stack.extend((t.op, False) for t in current.inputs
                             if _copied_input(t) and not self.knows(t))

    def _copy(self, op: tf.Operation) -> None:
        """Records what stands for `op`'s outputs."""
        inputs = [] if op.type in _NOT_COPIED else [self._input(t) for t in op.inputs]
        kind = _kind(op, inputs)
        if kind is not None and kind in self._inferred:
            outputs = [self._placeholder(o.dtype, dims)
                       for o, dims in zip(op.outputs, self._inferred[kind])]
        else:
            outputs = self._made(op, inputs)
            if kind is not None:
                self._inferred[kind] = [None if c.shape.rank is None else c.shape.as_list()
                                        for c in outputs]
        self._copies.update((o.name, c) for o, c in zip(op.outputs, outputs))

    def _made(self, op: tf.Operation, inputs: list) -> list:
        """The outputs of a copy of `op` reading `inputs`, their unknown
        dimensions assumed; placeholders where `op` is not copied or
        TensorFlow refuses the copy (sizes that do not fit together, as a
        squeeze of an unknown dimension)."""
        if op.type not in _NOT_COPIED and (op.inputs or op.type == "Const"):
            try:
                copy = compat.create_op_copy(self._scratch, op, inputs, keep_shapes=True)
                for new in copy.outputs:
                    if new.shape.rank is not None:
                        new.set_shape(self._assumed(new.shape))
                return copy.outputs
            except (ValueError, TypeError, tf.errors.OpError):
                pass
        return [self._placeholder(o.dtype, None if o.shape.rank is None else self._assumed(o.shape))
                for o in op.outputs]

    def _input(self, t: tf.Tensor) -> tf.Tensor:
        """What a copy reads for `t`: its copy, else a placeholder of its shape
        (unknown dimensions assumed)."""
        if t.name in self._copies:
            return self._copies[t.name]
        return self._placeholder(t.dtype, None if t.shape.rank is None else self._assumed(t.shape))

    def _assumed(self, shape: tf.TensorShape) -> list:
        return [d if d is not None else self.size for d in shape.as_list()]

    def _placeholder(self, dtype, dims) -> tf.Tensor:
        key = (dtype, None if dims is None else tuple(dims))
        if key not in self._shared:
            self._shared[key] = tf.compat.v1.placeholder(dtype, dims)
        return self._shared[key]


def _copied_input(t: tf.Tensor) -> bool:
    """Whether a copy's input `t` is copied itself, not a placeholder of its
    shape: unknown dimensions, or an integer value shape functions may read
    (a constant, a shape computed with `tf.shape`). A frozen graph's float
    constants are not copied."""
    return not t.shape.is_fully_defined() or t.dtype.is_integer


def _kind(op: tf.Operation, inputs: list):
    """What decides the shapes of `op`'s outputs where it reads no integer
    tensor (whose values may decide them) and makes none (whose value later
    shapes may read: `tf.shape`'s): its type, attributes and inputs' shapes.
    None for other ops."""
    if (not op.inputs or any(t.dtype.is_integer for t in op.inputs)
            or any(t.dtype.is_integer for t in op.outputs)):
        return None
    attrs = tuple(sorted((name, value.SerializeToString(deterministic=True))
                         for name, value in op.node_def.attr.items()
                         if not name.startswith("_")))  # colocation, XLA marks: no shapes
    shapes = tuple((c.dtype, None if c.shape.rank is None else tuple(c.shape.as_list()))
                   for c in inputs)
    return op.type, attrs, shapes
