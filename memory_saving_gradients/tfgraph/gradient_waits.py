"""Making recomputation wait for a gradient, through data as well as control.

TF's executor runs an op as soon as its inputs exist, so a recomputed op must
depend on the gradient that reaches it; XLA (jit_compile) drops control
inputs, so the dependency must be a data one. Used by copying.py, rewrite.py, the loop
reruns and the layer decorator.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat


# Per graph: the name of each tensor a gate waits for -> (the name of the
# gate's op, of the op reading the tensor's element for it, or None for a
# scalar) per gate. Names: a tensor held here would keep its graph alive.
_gates_of = weakref.WeakKeyDictionary()


def gradient_values(gradient):
    """The dense values of a gradient (Tensor or IndexedSlices)."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def gradient_tensors(gradient) -> list:
    """The tensors of a gradient: itself, or an IndexedSlices' parts."""
    if isinstance(gradient, tf.IndexedSlices):
        return [t for t in (gradient.values, gradient.indices, gradient.dense_shape)
                if t is not None]
    return [gradient]


def ancestors_among(ops, tensors) -> set:
    """The ops of `ops` that `tensors` depend on (data or control), by a walk
    back from their ops that stops outside `ops`."""
    return _walk_back(ops, [t.op for t in tensors])


def waits_for(ops, op: tf.Operation) -> set:
    """The ops of `ops` that `op` runs after (through its inputs or control inputs)."""
    return _walk_back(ops, runs_after(op))


def _walk_back(ops, todo) -> set:
    """The ops of `ops` among `todo` (a list, consumed) and what they run after."""
    found = set()
    add_ancestors(found, todo, set(ops).__contains__)
    return found


def add_ancestors(found: set, todo: list, within) -> None:
    """Adds to `found` the ops of `todo` (a list, consumed) that `within`
    accepts and those they run after through accepted ops; an op in `found`
    already is not walked again, so a set grown call by call costs one walk."""
    while todo:
        op = todo.pop()
        if op in found or not within(op):
            continue
        found.add(op)
        todo.extend(runs_after(op))


def runs_after(op: tf.Operation) -> list:
    """The ops `op` waits for directly: its inputs' ops and its control inputs."""
    return [t.op for t in op.inputs] + list(op.control_inputs)


def depends_on(later: tf.Operation, first: tf.Operation) -> bool:
    """True when a data or control path runs from `first` to `later` (`reaches`)."""
    return reaches(first, {later})


def reaches(first: tf.Operation, targets) -> bool:
    """True when a data or control path runs from `first` to an op of `targets`.

    A walk forward from `first` over every consumer and control output (the
    whole graph, so a path through any op counts, edges added by
    `compat.replace_input` too): for an op of the tf.gradients call in
    progress that is at most the rest of that call, where a walk back from
    `targets` read the whole forward graph once per pair asked, quadratic in
    depth."""
    seen, todo = set(), [first]
    while todo:
        op = todo.pop()
        if op in targets:
            return True
        if op not in seen:
            seen.add(op)
            todo.extend([c for t in op.outputs for c in t.consumers()] + compat.control_outputs(op))
    return False


def gates_waiting_for(tensor: tf.Tensor) -> list:
    """(gate op, element read) for each gate (`gate`) that waits for `tensor`.

    An op made a gate op's control input holds its level back until it has
    run (a weight's update: integrations/optimizer_waits.py); the gate op
    reads no buffer, so waiting there keeps no gradient alive. The element
    read is the op reading `tensor` for the gate (None for a scalar): once it
    has run, the tensor's other readers may take its buffer.
    """
    def op(name):
        return None if name is None else tensor.graph.get_operation_by_name(name)
    return [(op(gate), op(read))
            for gate, read in _gates_of.get(tensor.graph, {}).get(tensor.name, ())]


def is_numeric(dtype: tf.DType) -> bool:
    return dtype.is_floating or dtype.is_integer or dtype.is_complex


def gate(gradients: list):
    """A scalar that exists only once all `gradients` do; None if none is numeric.

    A level's recomputation waits for it: for the gradients reaching the
    level, and for every gradient the previous phase returned, so that
    phase's gradient ops, weight gradients (Conv2DBackpropFilter, ...)
    included, have run and its recomputed tensors are free. Without it,
    TensorFlow with one inter-op thread defers weight gradients to the end of
    the step and every level's copies stay alive together. It reads one
    element of each gradient: `g != g` is never NaN (unlike `0 * g` for an
    infinite g).
    """
    values = [gradient_values(g) for g in gradients if is_numeric(gradient_values(g).dtype)]
    if not values:
        return None
    reads = {}  # name of a value -> name of the op reading its element
    made = _gate_of(values, reads)
    waiting = _gates_of.setdefault(made.graph, {})
    for v in values:
        waiting.setdefault(v.name, []).append((made.op.name, reads.get(v.name)))
    return made


def _gate_of(values: list, reads: dict) -> tf.Tensor:
    """`gate` of the numeric `values`, noting the ops reading them in `reads`."""
    by_dtype = {}
    for v in values:
        by_dtype.setdefault(v.dtype, []).append(v)
    with tf.name_scope("wait_for_gradients"):
        flags = []
        for group in [g for dtype, g in by_dtype.items() if dtype in _ARITHMETIC]:
            elements = _first_elements(group, reads)
            flags.append(tf.raw_ops.NotEqual(x=elements, y=elements))
        others = [v for dtype, g in by_dtype.items() if dtype not in _ARITHMETIC for v in g]
        if not others:
            return tf.reduce_any(flags[0] if len(flags) == 1 else tf.concat(flags, axis=0))
        # Gradients no kernel slices or compares (float8_*, int4): waited for
        # by control edges (kept by the executor and Grappler, not by XLA).
        with tf.control_dependencies(others):
            return tf.identity(tf.reduce_any(tf.concat(flags, axis=0)) if flags
                               else tf.constant(False))


_MAX_SLICE_RANK = 8
# Dtypes a gate reads an element of (StridedSlice, Pack, NotEqual) and adds
# a zero to (AddV2, Mul): float8_* have no NotEqual nor AddV2, int4 no
# StridedSlice. Tensors of other dtypes wait by control edges instead.
_ARITHMETIC = frozenset({
    tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128,
    tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16, tf.uint32, tf.uint64})


def _first_elements(values: list, reads: dict) -> tf.Tensor:
    """A vector of the first element of each of `values` (tensors of one
    dtype; nothing of an empty one), noting in `reads` the name of the op
    reading each non-scalar's element.

    One op per tensor of known non-empty shape: a slice of one element per
    axis, each axis dropped. A gate reads every weight gradient of a level,
    and making ops is most of a rewrite's time: three ops per tensor made the
    gates a quarter of it on the 256-block MLP. Raw ops, on constants shared
    by the tensors of one rank, made without the op wrappers (compat.new_op).
    Tensors of unknown or empty shape, or of rank above 8 (StridedSlice's
    CPU kernel handles at most 8 dimensions), are flattened and sliced to at
    most one element.
    """
    constants = {}

    def const(*entries):  # an int32 vector, made once per call
        if entries not in constants:
            constants[entries] = tf.constant(entries, tf.int32)
        return constants[entries]

    scalars, vectors = [], []
    for v in values:
        rank = v.shape.rank
        if rank == 0:
            scalars.append(v)
        elif v.shape.is_fully_defined() and v.shape.num_elements() and rank <= _MAX_SLICE_RANK:
            ones = const(*[1] * rank)
            scalars.append(compat.new_op(
                "StridedSlice", [v, const(*[0] * rank), ones, ones], T=v.dtype, Index=tf.int32,
                shrink_axis_mask=(1 << rank) - 1).outputs[0])
            reads[v.name] = scalars[-1].op.name
        else:
            vectors.append(tf.raw_ops.StridedSlice(
                input=tf.raw_ops.Reshape(tensor=v, shape=const(-1)),
                begin=const(0), end=const(1), strides=const(1)))
            reads[v.name] = vectors[-1].op.name
    parts = ([compat.new_op("Pack", scalars, T=values[0].dtype, N=len(scalars)).outputs[0]]
             if scalars else []) + vectors
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def wait_for_gate(tensor: tf.Tensor, level_gate: tf.Tensor) -> tf.Tensor:
    """`tensor` plus a zero computed from `level_gate` (see `gate`).

    A data dependency that XLA must respect (it drops control inputs); XLA
    folds `x * 0` only for integers, so it stays.
    """
    with tf.name_scope("wait_for_gradient"):
        if tensor.dtype.base_dtype not in _ARITHMETIC:  # float8_*: no add; XLA may run it early
            with tf.control_dependencies([level_gate]):
                return tf.identity(tensor)
        return tensor + tf.cast(level_gate, tensor.dtype) * tf.zeros([], tensor.dtype)


def held_gate(level_gate):
    """A stand-in for `level_gate` for a level's seeds to wait for (`seed_after_gate`),
    made to wait for the level's copies too once its gradient ops exist
    (`hold_until_copied`); None if `level_gate` is None."""
    if level_gate is None:
        return None
    with tf.name_scope("wait_for_copies"):
        return tf.identity(level_gate)


def hold_until_copied(hold, level_gate, level_ops: list, copies: list, gradients: list) -> int:
    """Makes `hold` (`held_gate` of `level_gate`) exist only once every copy the
    level's backprop reads has run.

    The planner's timeline runs a level's copies, then its gradient ops; TF's
    executor with several threads ran a gradient op as soon as its inputs existed,
    beside the copies still running (EfficientNetB2: a batch norm's product of
    the gradient and the recomputed input beside its recomputed variance's
    squared differences, one more full-size buffer than predicted). The seeds
    read `hold`, and every gradient op waits for a seed (captured_reads.py).
    `level_ops`: the ops made for the level, in order; `copies`: its copied
    tensors; `gradients`: those its backprop made. Copies that wait for the seeds
    themselves (a loop rerun in turn, loop_rerun.py) are not waited for. A
    gradient the caller never fetches still counts: its copies then run where
    TensorFlow pruned them (as they do in a training step, which fetches all).
    The one edge that runs against creation order: `hold`, made before the
    gradient ops, reads the gate made after them (which reads only copies and
    `level_gate`, both older than `hold`); passes that take creation order for
    an order of runs (leaf_order.py, constant_push_down.py) see `hold` as
    carrying no gradient. Returns how many tensors `hold` waits for.
    """
    if hold is None:
        return 0
    among = set(level_ops)
    after_seeds = _walk_forward([hold.op], among)
    copy_ops = {t.op for t in copies}
    live = _walk_back(among, [t.op for g in gradients for t in gradient_tensors(g)])
    read = {}
    for op in level_ops:
        if op in live and (op not in copy_ops or op in after_seeds):
            for t in op.inputs:
                if t.op in copy_ops and t.op not in after_seeds and is_numeric(t.dtype):
                    read[t.name] = t
    if not read:
        return 0
    with tf.name_scope("wait_for_copies"):
        copied = _gate_of(list(read.values()), {})
        compat.replace_input(hold.op, 0, tf.logical_and(level_gate, copied))
    return len(read)


def _walk_forward(starts: list, among: set) -> set:
    """The ops of `among` that run after an op of `starts` (through data or control)."""
    found, todo = set(), list(starts)
    while todo:
        op = todo.pop()
        for later in [c for t in op.outputs for c in t.consumers()] + compat.control_outputs(op):
            if later in among and later not in found:
                found.add(later)
                todo.append(later)
    return found


def seed_after_gate(seed, level_gate):
    """`seed` (a dense gradient a level starts from), readable only once
    `level_gate` exists.

    Copies wait for the gate, but a gradient op reading only the seed (a
    mean's gradient tiles it to full size) does not: its level's backprop
    began as soon as the seed existed, beside the level above (MobileNetV2 at
    batch 144: a batch norm's mean and variance, each in a level of its own,
    tiled their gradients while the level above held its largest buffers).
    The seed each level's gradient ops read must be a node of its own:
    with oneDNN (on by default on CPUs with AVX-512 VNNI) the layout pass
    merges a Conv2DBackpropFilter with a BiasAddGrad reading the same node,
    without checking for a path between them, and the level above's bias
    gradient reads this seed too and is one the gate waits for: one op
    waiting for itself, "nodes in a cycle". An Identity with a control input
    (this function's first form) is bypassed by Grappler's dependency
    optimizer, and TF 2.16's constant folding reduces `seed + 0 * gate`
    (`wait_for_gate`) to the seed as well: its zero is a constant. Here the
    zero is the gate and its negation, both true never, which no optimizer
    folds (a Snapshot would stay too, but has no gradient, and second-order
    gradients differentiate this sum). It takes no buffer of its own once the
    gate has passed: the seed's other readers have run, and its buffer is
    forwarded.
    """
    if level_gate is None or not isinstance(seed, tf.Tensor):
        return seed
    if seed.dtype.base_dtype not in _ARITHMETIC:
        return wait_for_gate(seed, level_gate)
    with tf.name_scope("wait_for_gradient"):
        never = tf.logical_and(level_gate, tf.logical_not(level_gate))
        return seed + tf.cast(never, seed.dtype)
