"""Rewrite: execute a Plan on a TensorFlow graph.

The only module that adds ops (with copying.py and the loop modules). It
changes no existing op, except that a loop differentiated in chunks gains
outputs recording its state every k iterations (loop_recording.py), as
while_v2's own gradient adds accumulators. Backprop runs in three phases:

1. to the checkpoints: the stock tf.gradients from the ys through the
   original ops, stopping at the checkpoints;
2. level by level, last level first: copy the level's segment so it runs once
   the gradient reaches it and the previous phase has made all its gradients
   (weight gradients included, so its recomputed tensors are free, whatever
   the executor's thread count), differentiate the copies (the gradient ops
   start once the copies they read have all run, as the planner's timeline
   has it), and send the partial gradients on to the checkpoints, weights and
   xs the copies read;
3. to the xs: the weights' partial gradients (region tensors that depend only
   on xs) through the original ops, in one call.

Partial gradients meet in a `GradientLedger`. Each level's tf.gradients call
starts from per-level stubs (copying.Boundary), which keeps the rewrite
near-linear in graph size.
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf

from memory_saving_gradients.core.planning import Level
from memory_saving_gradients.core.planning import Plan
from memory_saving_gradients.tfgraph import broadcast_sinking
from memory_saving_gradients.tfgraph import capture_lookup
from memory_saving_gradients.tfgraph import captured_reads
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import constant_push_down
from memory_saving_gradients.tfgraph import copying
from memory_saving_gradients.tfgraph import gradient_order
from memory_saving_gradients.tfgraph import gradient_paths
from memory_saving_gradients.tfgraph import gradient_waits
from memory_saving_gradients.tfgraph import leaf_order
from memory_saving_gradients.tfgraph import ledger
from memory_saving_gradients.tfgraph import product_order
from memory_saving_gradients.tfgraph import conv_gradients
from memory_saving_gradients.tfgraph import grouped_conv_calls
from memory_saving_gradients.tfgraph import loop_chunks
from memory_saving_gradients.tfgraph import loop_rerun
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import max_pool_grad_grad
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import pool_gradients
from memory_saving_gradients.tfgraph import side_inputs
from memory_saving_gradients.tfgraph import workspace
from memory_saving_gradients.tfgraph.ledger import GradientLedger
from memory_saving_gradients.tfgraph.reading import Reading


def backprop(reading: Reading, plan: Plan, ys, xs, grad_ys, stop_gradients, tf_kwargs,
             unconnected) -> list:
    """Gradients of `ys` with respect to `xs` under `plan`. Returns a list."""
    graph = ys[0].graph
    first_new_op = len(graph.get_operations())
    # Second orders through max pools without the CPU MaxPoolGradGrad kernel,
    # which can return zeros (max_pool_grad_grad.py): in every call, stock
    # included, among the ops between xs and ys (the ones tf.gradients differentiates).
    with max_pool_grad_grad.argmax_gradients(reading.ops):
        found = _backprop(reading, plan, ys, xs, grad_ys, stop_gradients, tf_kwargs, unconnected)
    made = [op.name for op in graph.get_operations()[first_new_op:]
            if op.type in loops.LOOP_OP_TYPES]
    with _made_lock:
        _loops_made.setdefault(graph, set()).update(made)
    return found


# Per graph: the names of the loops our backprop made (reruns, chunks, their
# gradients), for `loops_made_before`. Replicas of a tf.distribute strategy
# trace in threads.
_loops_made: "weakref.WeakKeyDictionary[tf.Graph, set]" = weakref.WeakKeyDictionary()
_made_lock = threading.Lock()


def loops_made_before(ys, region) -> list:
    """The tensors of `region` (names) that loops an earlier call of ours
    made output, and the gradient of `ys` reaches (a walk back from them that
    does not pass ops without a gradient, such as StopGradient): this call
    would differentiate our gradients."""
    graph = ys[0].graph
    with _made_lock:
        made = _loops_made.get(graph, set())
    if not made:
        return []
    found, seen, todo = [], set(), [y.op for y in ys]
    while todo:
        op = todo.pop()
        if op in seen or not _differentiable(op.outputs[0]):
            continue
        seen.add(op)
        inputs = [t for t in op.inputs if t.name in region]
        found += [t.name for t in inputs if t.op.name in made]
        todo += [t.op for t in inputs]
    return sorted(set(found))


def _backprop(reading, plan, ys, xs, grad_ys, stop_gradients, tf_kwargs, unconnected) -> list:
    if plan.stock:  # predicted to save nothing: tf.gradients itself, no op of ours
        return list(compat.stock_gradients(ys, xs, grad_ys, name="backprop",
                                           stop_gradients=list(stop_gradients),
                                           unconnected_gradients=unconnected, **tf_kwargs))
    graph = ys[0].graph
    run = _Backprop(reading, plan, xs, stop_gradients, tf_kwargs, graph)
    in_region = {graph.get_tensor_by_name(n).op for n in reading.region}
    # Loops differentiated where they are (not copied) are rerun in chunks too,
    # but those the plan leaves to the stock gradient (`LoopModes.stacked`);
    # unit-stride convolutions, originals and copies, get gradients without
    # the CPU kernels' scratch where that takes less, and XLA-compiled depthwise ones without XLA's;
    # XLA-compiled max pools without XLA's index buffers (pool_gradients.py).
    # Our many tf.gradients calls look captures up by index (capture_lookup.py).
    chunked = {op for op in loop_chunks.rerunnable_in(graph, reading.region)
               if op.name not in plan.loops.stacked}
    with loop_chunks.chunked_gradients(chunked), \
            conv_gradients.scratch_free_gradients(
                [op for op in in_region if workspace.scratch_free_saves(op)]), \
            grouped_conv_calls.native_gradients(in_region), \
            pool_gradients.first_max_gradients(in_region), capture_lookup.indexed():
        run.to_checkpoints(ys, grad_ys)
        for number, level in reversed(list(enumerate(plan.levels))):
            run.through_level(number, level)
        run.to_xs()
    return run.results(unconnected)


def _backprop_ops(made: list) -> list:
    """The ops of `made` (what one tf.gradients call created, in order) that
    run in backprop. The others feed ops made before the call: a While
    loop's gradient gives the forward loop new inputs (while_v2's empty
    accumulators; the list holding a chunked loop's first state, made when
    a decorated layer's gradient is built, loop_recording.py). Those run in
    the forward pass: waiting for a seed, or reading a copy, would close a
    cycle through the forward loop."""
    among = set(made)
    feeding = [t for op in made for t in op.outputs
               if any(c not in among for c in t.consumers())]
    if not feeding:
        return made
    forward = gradient_waits.ancestors_among(made, feeding)
    return [op for op in made if op not in forward]


def _seeds_of(ys, grad_ys) -> list:
    """`grad_ys` with tf.gradients' own default (ones) made here for the float ys that
    have none, so the ops that carry the gradient are known (leaf_order.py)."""
    given = list(grad_ys) if grad_ys is not None else [None] * len(ys)
    return [tf.ones_like(y) if g is None and y.dtype.is_floating else g
            for y, g in zip(ys, given)]


def _seeds_stop_at_targets(targets, seeds, stops) -> bool:
    """True if tf.gradients would pass no seed through an op: every target is a
    float stop with its seed given (a decorated layer's call: its outputs are
    its checkpoints) and no function call's (differentiated at a stop)."""
    stop_names = {t.name for t in stops}
    return all(t.name in stop_names and t.dtype.is_floating and s is not None
               and not gradient_paths.is_function_call(t.op) for t, s in zip(targets, seeds))


def _seeds_at(sources, targets, seeds) -> list:
    """Each source's gradient when every target is a stop: the sum of the seeds
    of the targets it is, or None.

    What tf.gradients returns then, without its walk over every op downstream
    of the sources: per decorated layer that walk covers all the layers above
    it, and tracing n of them took time quadratic in n.
    """
    parts = {}
    for target, seed in zip(targets, seeds):
        # In this graph, as tf.gradients' grad_ys Identity: a seed may be
        # made elsewhere (an eager tensor a tf.function captures).
        parts.setdefault(target.name, []).append(tf.identity(seed))
    return [ledger.add_up(parts.get(source.name, [])) for source in sources]


def _differentiable(tensor: tf.Tensor) -> bool:
    """False for ops registered as not differentiable (random ops, shapes)."""
    try:
        return compat.gradient_function(tensor.op) is not None
    except LookupError:
        return True  # let tf.gradients raise its own error if it is ever needed


class _Backprop:
    """One `gradients` call in progress: the ledger and the checkpoints' seeds."""

    def __init__(self, reading, plan, xs, stop_gradients, tf_kwargs, graph):
        self._reading = reading
        self._plan = plan
        self._xs = list(xs)
        self._stops = list(stop_gradients)
        self._tf_kwargs = tf_kwargs
        self._graph = graph
        self._kept = [graph.get_tensor_by_name(n) for n in plan.kept]
        self._boundary = copying.Boundary(reading, plan.kept, xs, graph)
        self._side = side_inputs.SideInputs(
            lambda name: name not in reading.region and not self._boundary.holds(name))
        self._ledger = GradientLedger(made_after=graph.version)
        self._scratch_chain = gradient_order.ScratchChain()
        self._seeds = {}  # checkpoint -> its full gradient
        # The gradients the last phase returned: once they all exist, its
        # gradient ops have run and its recomputed tensors are free.
        self._released = []

    def to_checkpoints(self, ys, grad_ys) -> None:
        """Phase 1: from the ys through the original ops, down to the checkpoints."""
        # Each source once: tf.gradients answers every entry of a repeated
        # source (an x given twice, or an x that is also a checkpoint), and
        # every answer would be collected as one more partial gradient.
        sources = list({t.name: t for t in self._kept + self._xs}.values())
        # The forward tensors this call's gradients read are held until they run,
        # as a level's copies are: its leaf gradients are ordered too.
        held = [self._graph.get_tensor_by_name(n) for n in self._reading.region]
        # An x that is not a stop passes its gradient on here, to the xs it
        # depends on: that part must not go through its op again in phase 3
        # (x and h = sin(x) both xs: x's gradient counted h's part twice).
        stops = {t.name for t in self._kept + self._stops}
        passed_on = {x.name for x in self._xs if x.name not in stops}
        self._released = self._differentiate(sources, ys, _seeds_of(ys, grad_ys), self._kept,
                                             held=held, passed_on=passed_on)

    def through_level(self, number: int, level: Level) -> None:
        """Phase 2, one level: recompute its segment and differentiate it."""
        unsent = {}
        for c in level.checkpoints:
            settled = self._ledger.settle(c)
            if settled.total is not None:
                self._seeds[c] = settled.total
            if settled.unsent is not None:
                unsent[c] = settled.unsent
        with self._graph.name_scope(f"recompute_{number}"):
            copies, released = self._through_copies(level)
            kept = [self._graph.get_tensor_by_name(c) for c in level.checkpoints
                    if c in unsent and c not in copies]
            kept = [t for t in kept if _differentiable(t)]
            if kept:
                # Roots that cannot be recomputed (stateful, control flow):
                # differentiate the original ops.
                read = self._inputs_of(kept)
                released += self._differentiate(read, kept, [unsent[t.name] for t in kept], read)
        # Gradients no gate has waited for yet (a level that recomputes nothing
        # makes none) stay for the next one: else the leaf gradients of the
        # level above it (a bias gradient) ran at the end of the step with one
        # inter-op thread, holding their input gradient buffers.
        self._released = self._released + released

    def _through_copies(self, level: Level) -> tuple:
        """Copies and differentiates the level; returns (copies, gradients made)."""
        stubs, made = {}, {}
        first_op = len(self._graph.get_operations())
        arrived = [self._seeds[c] for c in level.checkpoints if c in self._seeds]
        level_gate = (gradient_waits.gate(arrived + self._released)
                      if level.copy_ops and self._reading.gated else None)
        if level_gate is not None:
            self._released = []  # waited for: the next gate need not read them

        def read(tensor):  # what a copy reads for a tensor outside its level
            again = self._side.made_again(tensor, made, level_gate)
            return again if again is not None else self._boundary.stub(tensor, stubs, level_gate)

        copies = copying.copy_level(self._graph, level, self._seeds, level_gate, read)
        roots = [c for c in level.checkpoints if c in copies and c in self._seeds]
        if not roots:
            return copies, []
        mapped = [copies.get(s.name, s) for s in self._stops]
        hold = gradient_waits.held_gate(level_gate)
        seeds = [gradient_waits.seed_after_gate(self._seeds[c], hold) for c in roots]
        gradients = self._differentiate(
            list(stubs.values()), [copies[c] for c in roots], seeds, mapped,
            names=list(stubs), copies=copies)
        # The level's gradient ops wait for its copies, as the timeline runs them.
        gradient_waits.hold_until_copied(hold, level_gate, self._graph.get_operations()[first_op:],
                                         list(copies.values()), gradients)
        return copies, gradients

    def to_xs(self) -> None:
        """Phase 3: the weights' partial gradients to the xs, in one pass.

        A variable's reads pass their gradients to its handle unchanged: their
        parts go to the handle's own, added up as they are made (stock adds
        them at the handle once the last is made: a block applied 8 times
        held 8 gradients of its weights)."""
        weights = [n for n in self._ledger.unsent_names() if self._reading.is_weight(n)]
        if self._reading.gated:  # control edges: not across tf.compat.v1 control flow contexts
            x_names, stops = {x.name for x in self._xs}, {t.name for t in self._stops}
            handles = {n: None if n in stops else op_kinds.plain_read_handle(
                self._graph.get_tensor_by_name(n), x_names) for n in weights}
            for name, handle in handles.items():
                if handle is not None:
                    self._ledger.move(name, handle)
            weights = [n for n in weights if handles[n] is None]
        if weights:
            xs = list({x.name: x for x in self._xs}.values())
            self._differentiate(xs, [self._graph.get_tensor_by_name(n) for n in weights],
                                [self._ledger.take_unsent(n) for n in weights], [])

    def results(self, unconnected) -> list:
        results, totals = [], {}
        kept = set(self._plan.kept)
        for x in self._xs:
            # An x inside the region is a checkpoint; its seed is its full gradient.
            # An x given twice is added up once.
            if x.name not in kept and x.name not in totals:
                totals[x.name] = self._ledger.total(x.name)
            grad = self._seeds.get(x.name) if x.name in kept else totals[x.name]
            if grad is None and unconnected == tf.UnconnectedGradients.ZERO:
                grad = compat.zeros_like_gradient(x)
            results.append(grad)
        return results

    def _differentiate(self, sources, targets, seeds, stops, names=None, copies=None,
                       held=(), passed_on=frozenset()) -> list:
        """Stock tf.gradients of `targets` to `sources`; records the parts.

        `copies`: original name -> copy, of a level's copies differentiated
        (the sources then are the level's stubs of what it reads from outside,
        `names` their originals). Gradient ops read the copies and stubs,
        never the originals (captured_reads.py), and leaf gradient readers of
        the copies run before backprop passes them (leaf_order.py); `held`:
        forward tensors whose leaf gradient readers do the same (the first call's);
        `passed_on`: sources tf.gradients also sends their part on from (the
        first call's xs that are not stops), recorded as sent.
        Returns the gradients it made (those that are not None)."""
        calls = {t.op for t in stops + self._stops if gradient_paths.is_function_call(t.op)}
        # A call at a stop is differentiated anyway, by SymbolicGradient, which
        # fails at run time on a function holding a loop; left out of our
        # stops it gets its registered gradient. The user's stops stay as given.
        stops = [t for t in stops if t.op not in calls] + self._stops
        first_new_op = len(self._graph.get_operations())
        # tf.compat.v1 TensorArray gradients meet in an accumulator named after
        # the gradient scope up to its last part starting with 'gradients'. A
        # scope name without that prefix keeps all our calls on the caller's
        # scope (as for one tf.gradients call), so a TensorArray read in one
        # call and written in another gets the whole gradient.
        if _seeds_stop_at_targets(targets, seeds, stops):
            grads = _seeds_at(sources, targets, seeds)
        else:
            grads = compat.stock_gradients(targets, sources, seeds, name="backprop",
                                           stop_gradients=stops, **self._tf_kwargs)
        new_ops = _backprop_ops(self._graph.get_operations()[first_new_op:])
        loop_rerun.one_iteration_at_a_time(new_ops)
        if self._reading.gated:  # not across tf.compat.v1 control flow contexts
            # Means' and sums' gradients added into x's by broadcasting, not
            # as full-size copies (broadcast_sinking.py); the ops they replace are left unread.
            grads, new_ops = broadcast_sinking.sink(new_ops, grads)
            # Constants Grappler would pair with forward tensors wait for the
            # gradient they scale (constant_push_down.py).
            new_ops = constant_push_down.pin(new_ops)
        recomputed = {t.ref() for t in held}
        if copies:
            captured_reads.read_copies(new_ops, {**dict(zip(names, sources)), **copies})
            if self._reading.gated:  # not across tf.compat.v1 control flow contexts
                captured_reads.wait_for_seeds(new_ops, seeds)
            recomputed = {t.ref() for t in copies.values()}
        made = [(n, g) for n, g in zip(names or [t.name for t in sources], grads) if g is not None]
        if self._reading.gated:
            self._order(new_ops, seeds, made, recomputed, first_call=bool(held))
        loop_rerun.start_reruns_in_turn(self._graph)
        # Function calls among the stops that tf.gradients differentiated all
        # the same (their gradient ops record them as their forward op).
        through = calls & {compat.forward_op_of_gradient(op) for op in new_ops} if calls else set()
        for name, g in made:
            sent = name in passed_on or (
                bool(through) and self._graph.get_tensor_by_name(name).op in through)
            self._ledger.add(name, g, sent=sent)
        return [g for _, g in made]

    def _order(self, new_ops, seeds, made, recomputed, first_call=False) -> None:
        """Orders the gradient ops one call made (scratch ones, leaves, a
        broadcast product's sum before its sibling product).

        `made`: (source name, gradient) pairs the call returned. In the first
        call (ys to checkpoints) the gradients to the xs end there too: only
        those to checkpoints go on to a level."""
        kept = set(self._plan.kept) if first_call else ()

        def ends(name):
            return self._reading.is_weight(name) or (first_call and name not in kept)
        to_weights = [g for n, g in made if ends(n)]
        onward = [g for n, g in made if not ends(n)]
        leaf_order.order_leaves(new_ops, seeds, recomputed, to_weights, onward)
        # After the leaves' edges: its weight-gradient-first swap (the one edge
        # against creation order) checks for a path back through them.
        self._scratch_chain.extend(new_ops, [g for _, g in made])
        product_order.sums_first(new_ops, [g for _, g in made])

    def _inputs_of(self, kept) -> list:
        """The tensors to differentiate kept roots to: what their ops read.

        Past a function call among them tf.gradients goes on to the call's own
        inputs, so those are taken too (and so on); else the gradient it sends
        there would be lost, or counted again where another root reads them.
        """
        read = {}
        names = [n for t in kept for n in self._reading.op_inputs[t.op.name]]
        for name in names:  # grows while it is walked
            if name in read or not self._boundary.holds(name):
                continue
            read[name] = tensor = self._graph.get_tensor_by_name(name)
            if gradient_paths.is_function_call(tensor.op):
                names.extend(self._reading.op_inputs.get(tensor.op.name, ()))
        return list(read.values())
