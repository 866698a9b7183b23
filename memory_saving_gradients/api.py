"""The public entry points: check the input, then run the pipeline.

graph model -> strategy -> plan -> rewrite. Everything here is about
argument handling and reporting; the work happens in the rooms (core/,
tfgraph/).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

import tensorflow as tf

from memory_saving_gradients import arguments
from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import peak_breakdown
from memory_saving_gradients.core import planning
from memory_saving_gradients.core import timeline
from memory_saving_gradients.core import strategies
from memory_saving_gradients.core.model import GraphModel
from memory_saving_gradients.tfgraph import captures
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import loop_chunks
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import reading
from memory_saving_gradients.tfgraph import rewrite
from memory_saving_gradients.tfgraph import sized_shapes

logger = logging.getLogger("memory_saving_gradients")

MODES = strategies.MODES
COLLECTION = "checkpoints"
# Per thread: how many `weight_gradients_taken` contexts are open.
_taken = threading.local()


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """What `gradients` would do, computed without changing the graph.

    Attributes:
      mode: 'collection', 'memory', 'speed', 'list', 'budget(...)',
        'memory_within(...)' or 'custom:<name>' (the strategy's name).
      checkpoints: tensors the mode chose to keep.
      pinned: tensors kept because they cannot be recomputed (outputs of
        stateful or control-flow ops, their inputs, xs inside the region).
      num_recomputed_ops: ops copied and rerun during backprop.
      num_forward_ops: ops between xs and ys.
      estimate: predicted memory and recompute cost (timeline.Estimate).
      notes: what the strategy chose and why, fallbacks taken, inputs ignored.
      plan, model: the core's plan and graph model, for inspection.
      feasible: False when the strategy could not meet its own target.
      result: the strategy's Result (chosen tensor names, plan, estimate).
      peak, stock_peak: where the plan's and tf.gradients' activation peaks
        fall and what holds them (`peak_breakdown.PeakBreakdown`; made by
        `checkpoint_plan` only).
    """
    mode: str
    checkpoints: tuple
    pinned: tuple
    num_recomputed_ops: int
    num_forward_ops: int
    estimate: timeline.Estimate
    notes: tuple
    plan: planning.Plan = dataclasses.field(repr=False)
    model: GraphModel = dataclasses.field(repr=False)
    reading: reading.Reading = dataclasses.field(repr=False)
    feasible: bool = True
    result: strategies.Result = dataclasses.field(default=None, repr=False)
    peak: peak_breakdown.PeakBreakdown = dataclasses.field(default=None, repr=False)
    stock_peak: peak_breakdown.PeakBreakdown = dataclasses.field(default=None, repr=False)

    def __str__(self):
        est = self.estimate
        lines = [
            f"mode {self.mode!r}: keep {len(self.checkpoints)} checkpoints "
            f"(+{len(self.pinned)} pinned), recompute {self.num_recomputed_ops} of "
            f"{self.num_forward_ops} forward ops",
            f"predicted activation memory {est.peak_bytes / 2**20:.1f} MiB vs "
            f"{est.baseline_bytes / 2**20:.1f} MiB for tf.gradients "
            f"({est.memory_ratio:.0%}), extra forward work "
            f"{est.recompute_flops / max(est.forward_flops, 1):.0%}",
        ]
        if est.allocator_peak_bytes is not None:
            lines.append(
                f"as the allocator counts it (whole chunks): {est.allocator_peak_bytes / 2**20:.1f}"
                f" MiB vs {est.allocator_baseline_bytes / 2**20:.1f} MiB for tf.gradients")
        # Not `est.peak_bytes` (the step's peak less every weight gradient):
        # the activations' own peak, each weight gradient left out while it lives.
        for whose, breakdown in (("", self.peak), ("tf.gradients' ", self.stock_peak)):
            if breakdown is not None:
                lines.append(f"{whose}peak of activations alone (weight gradients left out "
                             f"while they live): {breakdown.describe()}")
        lines += [f"checkpoint: {t.name} {t.shape} {t.dtype.name}" for t in self.checkpoints]
        lines += [f"note: {n}" for n in self.notes]
        if not self.feasible:
            lines.append("note: the strategy could not meet its target")
        return "\n".join(lines)


# Library code must not be rewritten by autograph when called in tf.function.
@tf.autograph.experimental.do_not_convert
def gradients(ys, xs, grad_ys=None, checkpoints="collection", **kwargs):
    """Drop-in for `tf.gradients` that keeps only checkpoints and recomputes the rest.

    Args:
      ys, xs, grad_ys: as for `tf.gradients` (tensors, or resource variables as xs).
      checkpoints: a list of tensors to keep; 'collection' (the tensors in
        the graph collection 'checkpoints'); 'memory' (the plan of least
        predicted peak); 'speed' (least peak recomputing only cheap ops);
        `budget(max_bytes)` (least recompute within a predicted activation
        peak); `memory_within(slack)` (least recompute within a share above
        'memory''s predicted peak); or a callable receiving the GraphModel
        and returning the names of the tensors to keep (a custom strategy).
      **kwargs: `name`, `gate_gradients`, `aggregation_method`,
        `stop_gradients`, `unconnected_gradients`, `colocate_gradients_with_ops`,
        passed on to `tf.gradients`.

    Returns:
      A list with one gradient (Tensor, IndexedSlices or None) per x.

    Raises:
      RuntimeError: when called eagerly (wrap the step in `tf.function`).
      TypeError / ValueError: on malformed arguments, naming the problem.
    """
    return gradients_in_region(ys, xs, grad_ys, checkpoints, None, **kwargs)


@tf.autograph.experimental.do_not_convert
def gradients_in_region(ys, xs, grad_ys, checkpoints, region_bound, **kwargs):
    """`gradients`, for a caller that knows every op between `xs` and `ys` is
    in `region_bound` (a set of ops, or None: the whole graph).

    A decorated layer's body holds every op between its inputs and outputs:
    searched from its inputs, the region would be sought over the whole graph
    above the layer, once per layer (time quadratic in the depth).
    """
    arguments.check_keywords(kwargs)
    ys, xs, grad_ys = arguments.normalise(ys, xs, grad_ys)
    stops, unconnected, name, tf_kwargs = arguments.tf_gradients_options(kwargs)
    if _recorded(ys, grad_ys):
        return compat.stock_gradients(ys, xs, grad_ys, name=name, stop_gradients=stops,
                                      unconnected_gradients=unconnected, **tf_kwargs)
    graph = ys[0].graph
    local, entries, sources = _sources(graph, xs)
    with _sized_for(checkpoints):  # the rewrite's batch parts as the plan priced them
        report = _plan(ys, sources, checkpoints, region_bound)
        logger.info("memory_saving_gradients: %s", str(report).replace("\n", "; "))
        with graph.name_scope(name):
            found = rewrite.backprop(report.reading, report.plan, ys, sources, grad_ys, stops,
                                     tf_kwargs, unconnected)
            by_x = dict(zip(map(id, local), found))
            outer = [x for x in xs if x.graph is not graph]
            if outer:
                by_x.update(zip(map(id, outer), captures.beyond(
                    entries, found[len(local):], outer, unconnected, stops)))
            return [by_x[id(x)] for x in xs]


def _recorded(ys, grad_ys) -> bool:
    """True (and a warning) if a recording GradientTape or a ForwardAccumulator
    watches what the gradients would be made from: it would record our ops as
    they are made, before the rewrite rewires some of them, and a higher order
    through them would be wrong. tf.gradients is used instead, as the tape
    integration does for a higher order."""
    watched = list(ys) + [t for g in grad_ys or () if g is not None
                          for t in tf.nest.flatten(g, expand_composites=True)]
    if not (compat.tape_would_record(watched) or compat.accumulator_would_record(watched)):
        return False
    logger.warning("memory_saving_gradients: a GradientTape or ForwardAccumulator is recording "
                   "and watches these ys or grad_ys, so it would record their gradient (a "
                   "higher order); tf.gradients is used, without recomputation. To save "
                   "memory, take the gradients outside the tape's or accumulator's `with` "
                   "block, or under tape.stop_recording()")
    return True


@tf.autograph.experimental.do_not_convert
def gradients_memory(ys, xs, grad_ys=None, **kwargs):
    """`gradients` keeping ~sqrt(n) bottleneck tensors (checkpoints='memory')."""
    return gradients(ys, xs, grad_ys, checkpoints="memory", **kwargs)


@tf.autograph.experimental.do_not_convert
def gradients_speed(ys, xs, grad_ys=None, **kwargs):
    """`gradients` keeping outputs of expensive ops (checkpoints='speed')."""
    return gradients(ys, xs, grad_ys, checkpoints="speed", **kwargs)


@tf.autograph.experimental.do_not_convert
def gradients_collection(ys, xs, grad_ys=None, **kwargs):
    """`gradients` keeping the tensors in the 'checkpoints' collection."""
    return gradients(ys, xs, grad_ys, checkpoints="collection", **kwargs)


@tf.autograph.experimental.do_not_convert
def checkpoint_plan(ys, xs, checkpoints="memory"):
    """The checkpoints and recompute count `gradients` would use; adds no ops.

    Example:
      >>> print(memory_saving_gradients.checkpoint_plan(loss, model.weights))
    """
    ys, xs, _ = arguments.normalise(ys, xs, None)
    with _sized_for(checkpoints):
        report = _plan(ys, _sources(ys[0].graph, xs)[2], checkpoints)
    # Only here (not in `gradients`): each replay costs about a plan's pricing.
    return dataclasses.replace(
        report, estimate=timeline.with_allocator_peaks(report.model, report.plan, report.estimate),
        peak=peak_breakdown.peak_breakdown(report.model, report.plan),
        stock_peak=peak_breakdown.peak_breakdown(report.model))


def validate_checkpoints(checkpoints) -> str:
    """The mode of a `checkpoints` argument; ValueError/TypeError if malformed."""
    mode = strategies.validate(checkpoints)
    if mode == "list":
        arguments.as_tensors(checkpoints, "checkpoints")
    return mode


def _sources(graph, xs):
    """(xs of `graph`, (captured, placeholder) pairs to cross, the tensors to plan from).

    xs of enclosing graphs are reached through this graph's captures; past
    them, tf.gradients goes on through the enclosing graphs' ops, and so do we.
    """
    local = [x for x in xs if x.graph is graph]
    entries = captures.differentiable_captures(graph) if len(local) < len(xs) else []
    return local, entries, local + [internal for _, internal in entries]


@contextlib.contextmanager
def weight_gradients_taken():
    """While open in this thread, `gradients` plans for a step whose
    optimizer, in the same graph, takes each weight gradient as it is made
    (Keras's own `fit` step): `"memory"` ranks plans by that step's peak
    (`GraphModel.weight_gradients_taken`). For integrations that know."""
    _taken.depth = getattr(_taken, "depth", 0) + 1
    try:
        yield
    finally:
        _taken.depth -= 1


def _check_batch_alone_unknown(graph, model, budget):
    """ValueError where a tensor of `model` grows faster than the batch
    `budget` was given: another dimension is unknown too, and sized as the
    batch its bytes would be a guess."""
    grown = sized_shapes.growing_past_linear(
        [graph.get_tensor_by_name(name) for name in model.unsized])
    if grown:
        raise ValueError(
            f"{budget.__name__} sizes the batch, but this step leaves another dimension "
            f"unknown too ({len(grown)} tensors, e.g. {grown[0].name!r}: {grown[0].shape}, "
            f"a sequence length?), so its bytes are not known: trace the step with that "
            f"dimension known (a tf.function input_signature, padded batches), or use a "
            f"mode ('memory', 'speed') or memory_within(slack)")


def _sized_for(checkpoints):
    """Where `checkpoints` is a budget given a batch size, a context in which
    the graph's unknown dimensions count as that size (`budgets.Budget`)."""
    size = checkpoints.batch_size if isinstance(checkpoints, budgets.Budget) else None
    return contextlib.nullcontext() if size is None else sized_shapes.unknown_dims_as(size)


def _plan(ys, xs, checkpoints, region_bound=None):
    read = reading.build_model(ys, xs, region_bound)
    model = read.model
    if isinstance(checkpoints, budgets.Budget) and checkpoints.batch_size and model.unsized:
        _check_batch_alone_unknown(ys[0].graph, model, checkpoints)
    if getattr(_taken, "depth", 0):
        model = dataclasses.replace(model, weight_gradients_taken=True)
    mode = strategies.validate(checkpoints)
    names = () if mode == "custom" else _explicit_names(read, ys, xs, mode, checkpoints)
    result = strategies.select(model, mode, names, checkpoints)
    graph = ys[0].graph
    ours = rewrite.loops_made_before(ys, read.region)
    if ours and not result.plan.stock:
        result = _stock_through_our_loops(model, result.strategy, ours)
    plan = result.plan
    kept = set(plan.chosen)
    return CheckpointPlan(
        mode=result.strategy,
        checkpoints=tuple(graph.get_tensor_by_name(n) for n in plan.chosen),
        pinned=tuple(graph.get_tensor_by_name(n) for n in plan.kept if n not in kept),
        num_recomputed_ops=plan.num_recomputed_ops,
        num_forward_ops=model.num_region_ops,
        estimate=result.estimate,
        # tf.gradients itself (a stock plan) reruns no loop.
        notes=result.notes + (() if plan.stock else loop_chunks.describe(
            graph, read.region, plan.loops.stacked)),
        plan=plan,
        model=model,
        reading=read,
        feasible=result.feasible,
        result=result)


def _stock_through_our_loops(model, strategy, ours):
    """tf.gradients itself for a call whose ys depend on loops an earlier call
    of ours made (a second order through recomputed or chunked loops): a plan
    recomputing them failed ("nodes in a cycle") or, with the loops rerun in
    chunks, gave wrong second orders."""
    note = (f"the ys depend on gradients of an earlier memory_saving_gradients call "
            f"through the loops it made ({ours[0]}, {len(ours)} tensors): recomputing "
            f"those is not supported, so this call differentiates as tf.gradients does "
            f"(nothing recomputed, no memory saved)")
    logger.warning("memory_saving_gradients: %s", note)
    return strategies.stock(model, strategy, (note,))


def _explicit_names(read, ys, xs, mode, checkpoints):
    """Names the 'collection' and 'list' modes keep, checked; () for other modes."""
    graph = ys[0].graph
    if mode == "collection":
        found = [t for t in graph.get_collection(COLLECTION)
                 if isinstance(t, tf.Tensor) and t.graph is graph]
        if not found:
            logger.warning("memory_saving_gradients: the %r collection is empty; "
                           "nothing is recomputed (same as tf.gradients). Add "
                           "tensors with tf.compat.v1.add_to_collection(%r, t).",
                           COLLECTION, COLLECTION)
        # Tensors elsewhere in the graph may be meant for other gradients calls.
        return [t.name for t in found]
    if mode != "list":
        return ()
    tensors = arguments.as_tensors(checkpoints, "checkpoints")
    arguments.check_same_graph(tensors, graph, "checkpoints")
    x_names = {x.name for x in xs}
    for t in tensors:
        if op_kinds.in_v1_control_flow(t.op, output=True):
            raise ValueError(f"checkpoint {t.name} is inside a tf.while_loop or tf.cond "
                             f"body; checkpoint the loop's or cond's outputs instead")
        if t.name not in read.region and t.name not in x_names:
            raise ValueError(f"checkpoint {t.name} is not between xs and ys: it does not "
                             f"depend on any x or no y depends on it; pass tensors on "
                             f"the path from xs to ys")
    return [t.name for t in tensors]
