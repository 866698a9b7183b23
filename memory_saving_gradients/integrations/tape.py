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
from memory_saving_gradients.integrations import optimizer_waits
from memory_saving_gradients.integrations import tape_record
from memory_saving_gradients.integrations import unrecorded
from memory_saving_gradients.tfgraph import compat

logger = logging.getLogger("memory_saving_gradients")

_RECORD = "_memory_saving_gradients_record"  # attribute holding a tape's tape_record.Record
_stock = {}  # method name -> the GradientTape method we wrapped
_state = {"active": lambda: None, "eager_logged": False}


def install(active: Callable[[], Optional[object]]) -> None:
    """Hooks GradientTape (once); `active()` gives the checkpoints in force, or None."""
    _state["active"] = active
    if _stock:
        return
    for name, wrapper in ((compat.TAPE_PUSH, _push_tape), (compat.TAPE_POP, _pop_tape),
                          ("reset", _reset), ("watch", _watch), ("gradient", _gradient),
                          ("jacobian", _stock_inside("jacobian")),
                          ("batch_jacobian", _stock_inside("batch_jacobian"))):
        _stock[name] = getattr(tf.GradientTape, name)
        setattr(tf.GradientTape, name, functools.wraps(_stock[name])(wrapper))
    compat.wrap_unrecorded_op_makers(unrecorded.noting)
    compat.wrap_tape_recorders(unrecorded.noting_recorded)


def _record(tape) -> tape_record.Record:
    if not hasattr(tape, _RECORD):
        setattr(tape, _RECORD, tape_record.Record())
    return getattr(tape, _RECORD)


def _push_tape(self):
    _stock[compat.TAPE_PUSH](self)
    if not tf.executing_eagerly():
        graph = tf.compat.v1.get_default_graph()
        _record(self).spans.setdefault(graph, []).append([graph.version, None])


def _pop_tape(self):
    _stock[compat.TAPE_POP](self)
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
    if checkpoints is None or compat.tape_is_spent(self):
        return stock()  # off, or a used non-persistent tape: stock raises
    if tf.executing_eagerly():
        if not _state["eager_logged"]:
            _state["eager_logged"] = True
            logger.info("memory_saving_gradients: eager GradientTape left alone (no graph to "
                        "rewrite); wrap the step in tf.function to checkpoint it")
        return stock()
    if compat.tape_is_recording(self) and not compat.tape_is_persistent(self):
        compat.stop_tape(self)  # as the stock gradient does
    reason, call = _plan_call(self, target, sources, output_gradients, unconnected_gradients,
                              checkpoints)
    if reason:
        logger.warning("memory_saving_gradients: GradientTape.gradient left to TensorFlow "
                       "(no checkpointing for this call): %s", reason)
        return stock()
    grads = call(checkpoints)
    if not compat.tape_is_persistent(self):
        compat.spend_tape(self)
    return tf.nest.pack_sequence_as(sources, grads)


def _plan_call(tape, target, sources, output_gradients, unconnected, checkpoints):
    """(reason to stay stock, None) or (None, function of checkpoints -> flat gradients)."""
    record = _record(tape)
    graph = tf.compat.v1.get_default_graph()
    if record.in_jacobian:
        return "jacobian/batch_jacobian", None
    if compat.tape_is_recording(tape):
        return ("persistent tape still recording (its gradient would be recorded: "
                "higher order)", None)
    if compat.any_tape_recording():
        return "another GradientTape or ForwardAccumulator is recording (higher order)", None
    if graph not in record.spans:
        return "the tape was not entered in this graph while checkpointing was installed", None
    targets = tf.nest.flatten(target)
    flat_sources = [tape_record.as_graph_tensor(graph, s) for s in tf.nest.flatten(sources)]
    if not targets or not all(tape_record.plain_target(graph, t) for t in targets):
        return "a target is not a floating-point tensor of this graph", None
    if any(s is tape_record.FOREIGN for s in flat_sources):
        return "a source is neither a variable nor a tensor this graph holds or captured", None
    if not all(s is None or s.dtype.is_floating or s.dtype == tf.resource
               for s in flat_sources):
        return "a source is not a floating-point tensor or variable", None
    seeds, reason = tape_record.watched_seeds(tape, record, graph)
    tracked = tape_record.tracked(seeds, record, graph)
    between = tape_record.between(
        targets, [s for s in flat_sources if s is not None and id(s) in tracked])
    reason = (reason or tape_record.unrecorded_path(record.recorded(graph), between)
              or tape_record.unmatched_output_gradients(targets, output_gradients)
              or tape_record.checkpoints_off_path(checkpoints, between, flat_sources))
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
    chosen = [(s, g) for s, g in zip(sources, given) if s is not None and id(s) in tracked]
    wanted = [s for s, _ in chosen]
    found = dict(zip(map(id, wanted), optimizer_waits.planned_for_updates(
        lambda: api.gradients(targets, wanted, grad_ys=grad_ys, checkpoints=checkpoints,
                              unconnected_gradients=unconnected),
        [g for _, g in chosen]) if wanted else []))
    zero = tf.UnconnectedGradients(unconnected) == tf.UnconnectedGradients.ZERO
    return [found[id(s)] if s is not None and id(s) in found
            else (_zeros(s, g) if zero else None) for s, g in zip(sources, given)]


def _zeros(source, given):
    if source is not None:
        return compat.zeros_like_gradient(source)
    return tf.zeros(given.shape, given.dtype)  # a variable the graph never read
