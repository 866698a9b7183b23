"""What a GradientTape recorded in a graph, and whether our rewrite would see the same.

The tape hook (tape.py) answers `tape.gradient` with `gradients` only where
the two walk the same ops: these are the facts it asks. A `Record` notes the
graph-version spans in which a tape recorded and the tensors it was told to
watch; the functions below find the tensors it tracks, the ops between
sources and targets, and the reasons (as sentences) a call must stay stock.
"""

import tensorflow as tf

from memory_saving_gradients.integrations import unrecorded
from memory_saving_gradients.tfgraph import captures
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import reading
from memory_saving_gradients.tfgraph.variables import as_tf_variable


class Record:
    """Where a tape recorded: per graph, spans of graph versions (op creation counts)."""

    def __init__(self):
        self.spans = {}  # graph -> list of [start, end or None] graph versions
        self.watched = []  # (what tape.watch was given, its graph then, graph version then)
        self.in_jacobian = False

    def recorded(self, graph):
        """Whether an op of `graph` was created while the tape recorded (not paused)."""
        spans = self.spans.get(graph, [])
        pauses = unrecorded.spans(graph)
        by_hand = unrecorded.recorded_by_hand(graph)

        def recorded(op):
            at = compat.creation_version(op)
            return (any(s < at and (e is None or at <= e) for s, e in spans)
                    and (op.name in by_hand or not any(s < at <= e for s, e in pauses)))
        return recorded


FOREIGN = object()  # a source as_graph_tensor cannot place in the graph


def as_graph_tensor(graph, source):
    """The tensor of `graph` standing for `source` (a variable: its handle).

    None for a variable the graph never read (unconnected), FOREIGN for
    anything else that is not a tensor of the graph or captured by it.
    """
    source = as_tf_variable(source)
    if isinstance(source, tf.Variable):
        return captures.local_tensor(graph, source.handle)
    if not isinstance(source, tf.Tensor) or not tf.is_symbolic_tensor(source):
        return FOREIGN
    local = captures.local_tensor(graph, source)
    return FOREIGN if local is None else local


def plain_target(graph, tensor):
    return (isinstance(tensor, tf.Tensor) and tf.is_symbolic_tensor(tensor)
            and tensor.graph is graph and tensor.dtype.is_floating)


def watched_seeds(tape, record, graph):
    """(tensors of `graph` the tape watches, reason to fall back or None).

    The tape records only ops made after a watch: a source explicitly
    watched after ops already used it (a tensor, or a variable on a tape
    not watching accessed variables) is left to the stock tape.
    """
    recorded = record.recorded(graph)
    seeds = [t for t in (captures.local_tensor(graph, v.handle) for v in tape.watched_variables())
             if t is not None]
    for source, where, version in record.watched:
        local = as_graph_tensor(graph, source)
        if local is None or local is FOREIGN:
            continue
        seeds.append(local)
        if isinstance(source, tf.Tensor) or not compat.tape_watches_accessed_variables(tape):
            if where is not graph:
                return seeds, f"{local.name} was watched in another graph"
            if any(recorded(c) and compat.creation_version(c) <= version
                   for c in local.consumers()):
                return seeds, f"{local.name} was watched after the tape recorded ops using it"
    return seeds, None


def tracked(seeds, record, graph):
    """ids of the tensors of `graph` the tape tracks: watched, or made from them by recorded ops."""
    tracked = {id(t) for t in seeds}
    recorded = record.recorded(graph)
    for op in graph.get_operations():
        if recorded(op) and any(id(t) in tracked and compat.is_trainable(t) for t in op.inputs):
            tracked.update(id(t) for t in op.outputs)
    return tracked


def between(targets, sources) -> set:
    """The ops on some path from a source to a target (the region `gradients` reads)."""
    return set(reading.region_ops(targets, sources))


def unrecorded_path(recorded, ops):
    """Why one of `ops` (those between sources and targets) is not on the tape as
    the rewrite sees it, or None."""
    for op in sorted(ops, key=compat.creation_id):
        # tf.gradients passes nothing through StopGradient either: unrecorded, it is the same.
        if not recorded(op) and op.type != "StopGradient":
            return (f"op {op.name} ({op.type}) between sources and target was created "
                    f"outside the tape's recording (before the tape, under stop_recording, "
                    f"by tf.stop_gradient or import_graph_def)")
        override = compat.override_tapes_ignore(op)
        if override is not None:
            return (f"op {op.name} ({op.type}) has a gradient_override_map gradient "
                    f"({override}), which the tape does not use")
    return None


def unmatched_output_gradients(targets, output_gradients):
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


def checkpoints_off_path(checkpoints, ops_between, sources):
    """Why a list of checkpoint tensors does not fit this call, or None."""
    if isinstance(checkpoints, str) or not isinstance(checkpoints, (list, tuple)):
        return None
    names = {s.name for s in sources if s is not None}
    for tensor in checkpoints:
        if (getattr(tensor, "op", None) not in ops_between
                and getattr(tensor, "name", None) not in names):
            return (f"checkpoint {getattr(tensor, 'name', tensor)} is not between this "
                    f"call's sources and target")
    return None
