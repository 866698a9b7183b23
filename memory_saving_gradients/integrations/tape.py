"""tf.GradientTape.gradient in a graph, answered by our rewrite while checkpointing is on.

Inside tf.function a tape's gradient is the gradient along the ops it
recorded, from the tensors and variables it watched. `gradients` walks every
op between sources and target, so it answers a call only when those are the
same: every op on a source-to-target path was created while this tape was
recording (not before it, not under `stop_recording`), and every source is
one the tape tracks. Anything else (eager, jacobians, another tape or forward
accumulator recording, composite tensors, a tape entered before the hook was
installed) goes to the stock tape, with a log line saying why.

`install()` wraps a few GradientTape methods once per process; while no
checkpointing is active the wrapped `gradient` is the stock one.
"""

import functools
import logging
from typing import Callable, Optional

import tensorflow as tf

from memory_saving_gradients import api
from memory_saving_gradients.integrations import unrecorded
from memory_saving_gradients.tfgraph import captures
from memory_saving_gradients.tfgraph import compat

logger = logging.getLogger("memory_saving_gradients")

_RECORD = "_memory_saving_gradients_record"  # attribute holding a tape's _Record
_stock = {}  # method name -> the GradientTape method we wrapped
_state = {"active": lambda: None, "eager_logged": False}


class _Record:
    """Where a tape recorded: per graph, spans of graph versions (op creation counts)."""

    def __init__(self):
        self.spans = {}  # graph -> list of [start, end or None] graph versions
        self.watched = []  # (tensor or variable given to tape.watch, graph version then)
        self.in_jacobian = False

    def recorded(self, graph):
        """Whether an op of `graph` was created while the tape recorded (not paused)."""
        spans = self.spans.get(graph, [])
        pauses = unrecorded.spans(graph)

        def recorded(op):
            at = compat.creation_version(op)
            return (any(s < at and (e is None or at <= e) for s, e in spans)
                    and not any(s < at <= e for s, e in pauses))
        return recorded


def install(active: Callable[[], Optional[object]]) -> None:
    """Hooks GradientTape (once); `active()` gives the checkpoints in force, or None."""
    _state["active"] = active
    if _stock:
        return
    for name, wrapper in (("_push_tape", _push_tape), ("_pop_tape", _pop_tape),
                          ("reset", _reset), ("watch", _watch), ("gradient", _gradient),
                          ("jacobian", _stock_inside("jacobian")),
                          ("batch_jacobian", _stock_inside("batch_jacobian"))):
        _stock[name] = getattr(tf.GradientTape, name)
        setattr(tf.GradientTape, name, functools.wraps(_stock[name])(wrapper))
    compat.wrap_unrecorded_op_makers(unrecorded.noting)


def _record(tape) -> _Record:
    if not hasattr(tape, _RECORD):
        setattr(tape, _RECORD, _Record())
    return getattr(tape, _RECORD)


def _push_tape(self):
    _stock["_push_tape"](self)
    if not tf.executing_eagerly():
        graph = tf.compat.v1.get_default_graph()
        _record(self).spans.setdefault(graph, []).append([graph.version, None])


def _pop_tape(self):
    _stock["_pop_tape"](self)
    for graph, spans in _record(self).spans.items():
        if spans[-1][1] is None:
            spans[-1][1] = graph.version


def _reset(self):
    _stock["reset"](self)
    record = _record(self)
    # reset() popped the old tape and pushed a new one: only that span counts.
    record.spans = {g: [s[-1]] for g, s in record.spans.items() if s and s[-1][1] is None}
    record.watched = []


def _watch(self, tensor):
    _stock["watch"](self, tensor)
    if not tf.executing_eagerly():
        graph = tf.compat.v1.get_default_graph()
        _record(self).watched.extend((t, graph, graph.version) for t in tf.nest.flatten(tensor))


def _stock_inside(name):
    """jacobian and batch_jacobian call gradient per row: those calls stay stock."""
    def method(self, *args, **kwargs):
        record = _record(self)
        outer, record.in_jacobian = record.in_jacobian, True
        try:
            return _stock[name](self, *args, **kwargs)
        finally:
            record.in_jacobian = outer
    return method


def _gradient(self, target, sources, output_gradients=None,
              unconnected_gradients=tf.UnconnectedGradients.NONE):
    def stock():
        return _stock["gradient"](self, target, sources, output_gradients, unconnected_gradients)

    checkpoints = _state["active"]()
    if checkpoints is None or self._tape is None:  # pylint: disable=protected-access
        return stock()  # off, or a used non-persistent tape: stock raises
    if tf.executing_eagerly():
        if not _state["eager_logged"]:
            _state["eager_logged"] = True
            logger.info("memory_saving_gradients: eager GradientTape left alone (no graph to "
                        "rewrite); wrap the step in tf.function to checkpoint it")
        return stock()
    if self._recording and not self._persistent:  # pylint: disable=protected-access
        self._pop_tape()  # pylint: disable=protected-access  (as the stock tape does)
    reason, call = _plan_call(self, target, sources, output_gradients, unconnected_gradients,
                              checkpoints)
    if reason:
        logger.warning("memory_saving_gradients: GradientTape.gradient left to TensorFlow "
                       "(no checkpointing for this call): %s", reason)
        return stock()
    grads = call(checkpoints)
    if not self._persistent:  # pylint: disable=protected-access
        self._watched_variables = self._tape.watched_variables()  # pylint: disable=protected-access
        self._tape = None  # pylint: disable=protected-access
    return tf.nest.pack_sequence_as(sources, grads)


def _plan_call(tape, target, sources, output_gradients, unconnected, checkpoints):
    """(reason to stay stock, None) or (None, function of checkpoints -> flat gradients)."""
    record = _record(tape)
    graph = tf.compat.v1.get_default_graph()
    if record.in_jacobian:
        return "jacobian/batch_jacobian", None
    if tape._recording:  # pylint: disable=protected-access
        return ("persistent tape still recording (its gradient would be recorded: "
                "higher order)", None)
    if compat.any_tape_recording():
        return "another GradientTape or ForwardAccumulator is recording (higher order)", None
    if graph not in record.spans:
        return "the tape was not entered in this graph while checkpointing was installed", None
    targets = tf.nest.flatten(target)
    flat_sources = [_as_graph_tensor(graph, s) for s in tf.nest.flatten(sources)]
    if not targets or not all(_plain(graph, t) for t in targets):
        return "a target is not a floating-point tensor of this graph", None
    if any(s is _FOREIGN for s in flat_sources):
        return "a source is neither a variable nor a tensor this graph holds or captured", None
    if not all(s is None or s.dtype.is_floating or s.dtype == tf.resource
               for s in flat_sources):
        return "a source is not a floating-point tensor or variable", None
    seeds, reason = _watched_seeds(tape, record, graph)
    tracked = _tracked(seeds, record, graph)
    between = _between(targets, [s for s in flat_sources if s is not None and id(s) in tracked])
    reason = (reason or _unrecorded_path(record.recorded(graph), between)
              or _unmatched_output_gradients(targets, output_gradients)
              or _checkpoints_off_path(checkpoints, between, flat_sources))
    if reason:
        return reason, None
    grad_ys = None if output_gradients is None else [
        None if g is None else tf.convert_to_tensor(g) for g in tf.nest.flatten(output_gradients)]
    return None, lambda checkpoints: _answer(
        targets, flat_sources, tf.nest.flatten(sources), tracked, grad_ys, unconnected,
        checkpoints)


def _answer(targets, sources, given, tracked, grad_ys, unconnected, checkpoints):
    """Ours for tracked sources; what the tape gives the others (None or zeros).

    `sources` are the graph tensors standing for the `given` sources (None
    for a variable this graph never read).
    """
    wanted = [s for s in sources if s is not None and id(s) in tracked]
    found = dict(zip(map(id, wanted), api.gradients(
        targets, wanted, grad_ys=grad_ys, checkpoints=checkpoints,
        unconnected_gradients=unconnected) if wanted else []))
    zero = tf.UnconnectedGradients(unconnected) == tf.UnconnectedGradients.ZERO
    return [found[id(s)] if s is not None and id(s) in found
            else (_zeros(s, g) if zero else None) for s, g in zip(sources, given)]


def _zeros(source, given):
    if source is not None:
        return compat.zeros_like_gradient(source)
    return tf.zeros(given.shape, given.dtype)  # a variable the graph never read


_FOREIGN = object()  # a source _as_graph_tensor cannot place in the graph


def _as_graph_tensor(graph, source):
    """The tensor of `graph` standing for `source` (a variable: its handle).

    None for a variable the graph never read (unconnected), _FOREIGN for
    anything else that is not a tensor of the graph or captured by it.
    """
    if isinstance(getattr(source, "value", None), tf.Variable):
        source = source.value  # a Keras 3 variable wraps a tf.Variable
    if isinstance(source, tf.Variable):
        return captures.local_tensor(graph, source.handle)
    if not isinstance(source, tf.Tensor) or not tf.is_symbolic_tensor(source):
        return _FOREIGN
    local = captures.local_tensor(graph, source)
    return _FOREIGN if local is None else local


def _plain(graph, tensor):
    return (isinstance(tensor, tf.Tensor) and tf.is_symbolic_tensor(tensor)
            and tensor.graph is graph and tensor.dtype.is_floating)


def _watched_seeds(tape, record, graph):
    """(tensors of `graph` the tape watches, reason to fall back or None).

    The tape records only ops made after a watch: a source explicitly
    watched after ops already used it (a tensor, or a variable on a tape
    not watching accessed variables) is left to the stock tape.
    """
    recorded = record.recorded(graph)
    seeds = [t for t in (captures.local_tensor(graph, v.handle) for v in tape.watched_variables())
             if t is not None]
    for source, where, version in record.watched:
        local = _as_graph_tensor(graph, source)
        if local is None or local is _FOREIGN:
            continue
        seeds.append(local)
        if isinstance(source, tf.Tensor) or not tape._watch_accessed_variables:  # pylint: disable=protected-access
            if where is not graph:
                return seeds, f"{local.name} was watched in another graph"
            if any(recorded(c) and compat.creation_version(c) <= version
                   for c in local.consumers()):
                return seeds, f"{local.name} was watched after the tape recorded ops using it"
    return seeds, None


def _tracked(seeds, record, graph):
    """ids of the tensors of `graph` the tape tracks: watched, or made from them by recorded ops."""
    tracked = {id(t) for t in seeds}
    recorded = record.recorded(graph)
    for op in graph.get_operations():
        if recorded(op) and any(id(t) in tracked and _trainable(t) for t in op.inputs):
            tracked.update(id(t) for t in op.outputs)
    return tracked


def _trainable(tensor):
    dtype = tensor.dtype
    return dtype.is_floating or dtype.is_complex or dtype in (tf.resource, tf.variant)


def _between(targets, sources):
    """The ops on some path from a source to a target."""
    upstream = set()
    stack = [t.op for t in targets]
    while stack:
        op = stack.pop()
        if op not in upstream:
            upstream.add(op)
            stack.extend(t.op for t in op.inputs)
    between = set()
    stack = [c for s in sources for c in s.consumers()]
    while stack:
        op = stack.pop()
        if op in upstream and op not in between:
            between.add(op)
            stack.extend(c for t in op.outputs for c in t.consumers())
    return between


def _unrecorded_path(recorded, between):
    """Why some op between sources and targets is not on the tape as the rewrite sees it, or None."""
    for op in sorted(between, key=compat.creation_id):
        # tf.gradients passes nothing through StopGradient either: unrecorded, it is the same.
        if not recorded(op) and op.type != "StopGradient":
            return (f"op {op.name} ({op.type}) between sources and target was created "
                    f"outside the tape's recording (before the tape, under stop_recording, "
                    f"by tf.stop_gradient or import_graph_def)")
        override = op.node_def.attr.get("_gradient_op_type")
        if override is not None and not override.s.startswith(b"CustomGradient"):
            return (f"op {op.name} ({op.type}) has a gradient_override_map gradient "
                    f"({override.s.decode()}), which the tape does not use")
    return None


def _unmatched_output_gradients(targets, output_gradients):
    """Why output_gradients are not each of their target's shape and dtype, or None."""
    if output_gradients is None:
        return None
    for target, given in zip(targets, tf.nest.flatten(output_gradients)):
        if given is None:
            continue
        given = tf.convert_to_tensor(given)
        if given.dtype != target.dtype or given.shape.rank != target.shape.rank \
                or not given.shape.is_compatible_with(target.shape):
            return (f"output_gradients for {target.name} are {given.dtype.name}{given.shape}, "
                    f"not of the target's dtype and shape (the tape broadcasts; we do not)")
    return None


def _checkpoints_off_path(checkpoints, between, sources):
    """Why a list of checkpoint tensors does not fit this call, or None."""
    if isinstance(checkpoints, str) or not isinstance(checkpoints, (list, tuple)):
        return None
    names = {s.name for s in sources if s is not None}
    for tensor in checkpoints:
        if getattr(tensor, "op", None) not in between and getattr(tensor, "name", None) not in names:
            return f"checkpoint {getattr(tensor, 'name', tensor)} is not between this call's sources and target"
    return None
