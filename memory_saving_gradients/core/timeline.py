"""Timeline: predict the memory and recompute cost of backprop, as TensorFlow runs it.

No TensorFlow. The simulator replays one training step op by op: the forward
pass, then backprop phase by phase (the tail from the ys down to the last
checkpoints, then each level of the plan: its copies in topological order,
then its gradient ops in reverse). Every tensor is allocated when its op
runs and freed after its last reader, as TensorFlow's executor does; a
forward tensor's readers include the gradient ops that read it (from
`model.grad_reads`, learnt from TensorFlow's registered gradients), so only
what backprop needs is kept. Gradient ops also hold their output gradients
and their scratch buffers (`model.workspace`) while they run; in a plan's
tail, a convolution's filter gradient that is a chain of per-tap products
(`model.trailing_workspace`) keeps its scratch and what it reads through the
gradients after it, up to and with the next such chain's gradient, as the
executor runs them side by side (in a level, leaf gradients are ordered
before backprop moves on).
While loops are priced by `loop_events.LoopEvents`. Ops run one at a time,
as with one inter-op thread; TensorFlow's default threading runs independent
ops side by side and measures higher on some models (see docs/planner.md).

`predict(model)` prices stock `tf.gradients`; `predict(model, plan)` a plan.
Both are linear in the size of the model. What every plan of a model shares
(the op table, the original ops' forward pass, tf.gradients' peak) is worked
out once per model (`op_table.per_model`): strategies price many plans.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import numpy as np

from memory_saving_gradients.core import allocator
from memory_saving_gradients.core import loop_chunking
from memory_saving_gradients.core import op_table
from memory_saving_gradients.core import stock_order
from memory_saving_gradients.core.loop_events import LoopEvents
from memory_saving_gradients.core.model import GraphModel
from memory_saving_gradients.core.planning import Plan

# Ops whose output shares its input's buffer (TensorFlow forwards it): they
# allocate nothing, and the input lives as long as the output is read.
ALIASING_OP_TYPES = frozenset({"Reshape", "Identity", "ExpandDims", "Squeeze",
                               "StopGradient", "PreventGradient"})

# Buffers a kernel may write its result over: those the replay allocates for
# tensors and gradients (a loop's buffers and weight gradients are not).
_FORWARDABLE_KINDS = frozenset({"fwd", "copy", "grad", "sum"})

# Keep a forward tensor alive until the end of the step (ys, gradients that
# nothing consumes): a step number later than any real one.
_END = float("inf")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Predicted cost of a plan, in bytes and FLOPs.

    Attributes:
      peak_bytes: predicted peak of the step minus the weight gradients it
        returns: activations, their gradients and scratch buffers (what the
        benchmarks measure as activation memory).
      kept_bytes: bytes of all checkpoints.
      largest_segment_bytes: bytes of the biggest level the plan recomputes.
      baseline_bytes: `peak_bytes` of stock tf.gradients on the same model.
      recompute_flops: extra forward work, summed over the copies that run.
      forward_flops: work of one forward pass over the region, for scale.
      allocator_peak_bytes: `peak_bytes` as TensorFlow's BFC allocator counts
        it (the chunks handed out, `core/allocator.py`); None until
        `with_allocator_peaks` works it out (the final plan only).
      allocator_baseline_bytes: the same for stock tf.gradients.
    """
    peak_bytes: int
    kept_bytes: int
    largest_segment_bytes: int
    baseline_bytes: int
    recompute_flops: int
    forward_flops: int
    allocator_peak_bytes: Optional[int] = None
    allocator_baseline_bytes: Optional[int] = None

    @property
    def memory_ratio(self) -> float:
        """Predicted peak as a fraction of tf.gradients' activation memory."""
        return self.peak_bytes / max(self.baseline_bytes, 1)


def predict(model: GraphModel, plan: Optional[Plan] = None) -> Estimate:
    """Prices `plan` on `model` (None: stock tf.gradients). O(size of the model).

    Example: on a chain of n tanh ops of b bytes each, stock tf.gradients keeps
    every output (tanh's gradient reads it), so `predict(model).peak_bytes` is
    about (n + 2) * b: the outputs plus two gradients in flight.
    """
    baseline = _baseline_peak(model)
    if _is_stock(plan):
        peak, recompute, largest, kept = baseline, 0, 0, 0
    else:
        replay = _Replay(model, stacked=plan.loops.stacked)
        peak = replay.run(plan.levels)
        recompute, largest = replay.recompute_flops, replay.largest_level_bytes
        kept = model.bytes_of(plan.kept)
    return Estimate(
        peak_bytes=peak, kept_bytes=kept, largest_segment_bytes=largest,
        baseline_bytes=baseline, recompute_flops=recompute,
        forward_flops=op_table.per_model(model, "forward_flops", _forward_flops))


def with_allocator_peaks(model: GraphModel, plan: Optional[Plan],
                         estimate: Estimate) -> Estimate:
    """`estimate` with its allocator-level peaks (`allocator.peak_chunk_bytes`).

    A replay of the plan's allocations through a simulated BFC allocator:
    slower than `predict`, so it is run on the plan a strategy chose, not on
    every plan the solvers price.
    """
    stock = op_table.per_model(model, "allocator_baseline",
                               lambda m: _allocator_peak(_Replay(m, stock=True), ()))
    planned = stock if _is_stock(plan) else _allocator_peak(
        _Replay(model, stacked=plan.loops.stacked), plan.levels)
    return dataclasses.replace(estimate, allocator_peak_bytes=planned,
                               allocator_baseline_bytes=stock)


def stock_peak_range(model: GraphModel, threads: int = 1) -> tuple:
    """(low, high): stock tf.gradients' peak replayed in the executor's order.

    `stock_order.parts` runs stock backprop through a simulation of
    TensorFlow's ready queue with `threads` inter-op threads, once with each
    out-edge order it cannot tell apart (a data gradient listed after its
    weight gradient, or before), and replays each order one op at a time. With
    one thread, weight gradients listed first wait until the chain of data
    gradients stops, holding their reads: the high end. Which order the
    executor sees is the optimized graph's, measured to differ between layers
    of one model (docs/planner.md), so this is a range, not `predict`'s point.
    """
    peaks = [_Replay(model, stock=True,
                     stock_parts=stock_order.parts(model, threads, data_last)).run(())
             for data_last in (False, True)]
    return min(peaks), max(peaks)


def _is_stock(plan: Optional[Plan]) -> bool:
    """True when `plan` runs tf.gradients itself (None, or a stock plan)."""
    return plan is None or plan.stock


def _allocator_peak(replay, levels):
    replay.run(levels)
    events = allocator.lifetime_events(replay.born, replay.last_use, replay.transient,
                                       replay.pieces)
    # The variables (each the size of its gradient) were allocated before the step.
    variables = replay.model.weight_grad_bytes.values()
    return (allocator.peak_chunk_bytes(events, held_before=variables)
            - replay._weight_grad_bytes())  # pylint: disable=protected-access


def _forward_flops(model):
    return sum(row.cost for row in op_table.rows(model).values())


def _baseline_peak(model):
    """tf.gradients' peak, once per model: the solver prices many plans per model."""
    return op_table.per_model(model, "baseline_peak",
                              lambda m: _Replay(m, stock=True).run(()))


def step_peaks(model: GraphModel, plan: Optional[Plan] = None) -> tuple:
    """(whole-step peak, activation peak) of `plan` (None: stock tf.gradients), in bytes.

    The whole-step peak counts each weight gradient from the step that makes
    it, as the allocator does; the activation peak leaves the weight
    gradients out at every step, so it is the most the activations, their
    gradients and scratch hold at one time. `Estimate.peak_bytes` is neither:
    it is the whole-step peak minus every weight gradient, less than the
    activations at the peak where that peak comes before the last weight
    gradients exist (ResNet50 at 64 px: 90 MiB of weight gradients, most of
    them made early in backprop; docs/planner.md).

    Stock's steps are in the executor's order where `model.deferred_weight_gradient_types`
    says its weight gradients wait (one inter-op thread). `predict`, which the
    strategies compare plans with, keeps the one-op-at-a-time replay: whether they
    wait depends on the optimized graph's out-edge order, and a choice of stock
    relying on it would lose most of a plan's saving where the order differs
    (ResNet50 at 64 px, one thread: stock's step 3.5 MiB above its weight
    gradients where they wait, 47 predicted where they do not; the plan's 12.4).
    """
    parts = None
    if _is_stock(plan) and model.deferred_weight_gradient_types:
        parts = op_table.per_model(model, "one_thread_order", stock_order.one_thread_order)
    replay = _replayed(model, plan, parts)
    return replay._peak(), _without_weight_gradients(replay)


def activation_peak(model: GraphModel, plan: Optional[Plan] = None) -> int:
    """`step_peaks`' activation peak, stock's replayed one op at a time as
    `predict` replays it: what the step holds where each weight gradient is
    taken as it is made (an optimizer in the same graph updating each weight
    from its own gradient alone, as Keras 3's does under `fit` once Grappler
    has removed the IdentityN over them all) instead of held to the end."""
    if _is_stock(plan):
        return op_table.per_model(model, "stock_activation_peak",
                                  lambda m: _without_weight_gradients(_replayed(m, None)))
    return _without_weight_gradients(_replayed(model, plan))


class ActivationTimeline:
    """The activations' bytes at each step of a replayed step (weight
    gradients left out, as `activation_peak` leaves them out), what ran in
    each step and what was alive then.

    Attributes:
      live: bytes alive at each step (a NumPy array); its max is
        `activation_peak(model, plan)`.
      running: step -> (what ran: "forward" | "recompute" | "gradient", op
        name, phase: "forward pass", "backprop" (tf.gradients), "tail" (a
        plan's gradients above its checkpoints) or the plan's level number,
        0 nearest the inputs and differentiated last). An op no gradient
        reaches takes its step with nothing run.
    """

    def __init__(self, model: GraphModel, plan: Optional[Plan] = None):
        self._replay = _replayed(model, plan)
        self._weights = frozenset(self._replay.weight_keys)
        self.live = self._replay._live(self._weights)  # pylint: disable=protected-access
        self.running = self._replay.running

    def contents(self, step: int) -> tuple:
        """(the buffers alive at `step` as (key, bytes); the scratch of that
        step as {"kernel" | "loop": bytes}); they sum to `live[step]`.

        A buffer is named by the latest key alive then that holds it: a
        result written over an input's buffer (`_take_forwarded_buffers`: a
        ReLU over its convolution's output) names it from then on. A key
        says what its buffer holds: ("fwd", tensor) a forward tensor still
        held, ("copy", level, tensor) a recomputed one, ("grad", op, tensor)
        and ("sum", tensor) gradients, ("early", op) gradient parts made in
        the forward pass, ("weights", op) a part of a weight's gradient and
        ("dense", op) a sparse part made dense (`_weight_gradient`); loops'
        kept states have keys of their own (`LoopEvents`). Loop scratch is
        what a loop's gradient reruns and rewrites (`LoopEvents._loop_backward`)."""
        replay = self._replay
        born, last_use = replay.born, replay.last_use

        def alive(key):
            return born[key][0] <= step <= last_use[key]

        holder = {}  # buffer key -> the latest key alive at `step` sharing it
        for key in replay.alias:
            if alive(key):
                root = replay._root(key)  # pylint: disable=protected-access
                if born[key][0] >= born[holder.get(root, root)][0]:
                    holder[root] = key
        buffers = [(holder.get(key, key), size) for key, (_, size) in born.items()
                   if size and key not in self._weights and alive(key)]
        scratch = {}
        for index, (at, size) in enumerate(replay.transient):
            if at == step and size:
                kind = replay.transient_kinds.get(index, "kernel")
                scratch[kind] = scratch.get(kind, 0) + size
        return buffers, scratch


def _replayed(model, plan, stock_parts=None):
    """The replay of `plan` (stock tf.gradients': None), run."""
    stock = _is_stock(plan)
    replay = _Replay(model, stock=stock, stacked=frozenset() if stock else plan.loops.stacked,
                     stock_parts=stock_parts)
    replay.run(() if stock else plan.levels)
    return replay


def _without_weight_gradients(replay) -> int:
    return int(replay._live(frozenset(replay.weight_keys)).max())  # pylint: disable=protected-access


def op_order(model: GraphModel) -> tuple:
    """Op names in topological order (by their first output in `model.order`)."""
    return op_table.order(model)


def gradient_reads(model: GraphModel, op: str) -> tuple:
    """Activation tensors the gradient of `op` reads, then those made outside
    the region it reads (`GraphModel.outside_reads`).

    Models that do not say (hand-built ones) are assumed to read every
    activation input and output, as most ops' gradients do.
    """
    return op_table.rows(model)[op].reads


def op_inputs(model: GraphModel, op: str) -> tuple:
    """Activation tensors `op` reads, each once."""
    return op_table.rows(model)[op].inputs


class _Replay(LoopEvents):
    """One replay of the step: intervals of live bytes on a step counter.

    `stock`: replay stock tf.gradients, whose gradient ops' scratch is
    `model.stock_workspace` where it differs from the rewrite's, and whose
    loops keep every iteration (ours may chunk them). `stacked`: the loops the
    plan leaves to the stock gradient too (`planning.LoopModes`).
    `stock_parts`: the order stock backprop runs its gradient parts in
    (`stock_order`); by default one op at a time in reverse.
    """

    def __init__(self, model, stock=False, stacked=frozenset(), stock_parts=None):
        self.model = model
        self.stock_parts = stock_parts  # the executor's order of stock backprop (`stock_order`)
        self.planned = not stock
        self.stacked = stacked
        self.workspace = {**model.workspace, **model.stock_workspace} if stock else model.workspace
        self.copied = frozenset()  # ops the levels copy: their originals get no gradient
        self.tensors = model.tensors
        self.rows = op_table.rows(model)
        self.ys = frozenset(model.ys)
        self.step = 0
        self.born = {}      # buffer key -> (first step, bytes)
        self.last_use = {}  # buffer key -> last step it is read
        self.transient = []  # (step, bytes) of scratch buffers
        self.transient_kinds = {}  # `transient` index -> "loop" where not a kernel's
        self.pieces = {}    # buffer key -> how many separate buffers it stands for
        self.pending = {}   # tensor name -> keys of gradient parts waiting for its op
        self.alias = {}     # buffer key -> the key whose buffer it shares
        self.weight_keys = set()  # buffer keys of the weight gradients
        self.weight_parts = {}  # `WeightSum` -> (op, key, step, phase) of its parts made
        self.forwards = []  # (step, key, candidate keys): `_take_forwarded_buffers`
        self.trailing_keys = frozenset()  # reads of a gradient part still running beside
        self.scratch_forwards = []  # (step, `transient` index, [(candidate key, bytes)])
        self.recompute_flops = 0
        self.largest_level_bytes = 0
        self.running = {}  # step -> (what ran, op, phase): `ActivationTimeline.running`
        self.phase = "forward pass"

    def run(self, levels):
        """Replays forward and backprop under `levels`; returns the activation peak."""
        model = self.model
        order = op_order(model)
        copied = {op for level in levels for op in level.copy_ops}
        kept_roots = {model.op_of(c) for level in levels for c in level.checkpoints} - copied
        self.copied = copied
        self._forward_pass()
        self.phase = "tail" if self.planned else "backprop"
        tail = [op for op in order if op not in copied and op not in kept_roots]
        if self.stock_parts is not None and not levels:
            self._backward_parts(self.stock_parts)
        else:
            self._backward(tail, {})
        for number in reversed(range(len(levels))):
            self._level(number, levels[number], kept_roots)
        self._add_up_weight_parts()
        self._take_forwarded_buffers()
        return self._peak() - self._weight_grad_bytes()

    def _forward_pass(self):
        """Runs the original ops. What they allocate and read is the same for
        every plan of the model, but for loops (stacks or chunk states, by
        plan): that is replayed once per model and copied, the loops added."""
        done = op_table.per_model(self.model, "forward_pass", _forward_pass_of)
        self.born, self.last_use = dict(done.born), dict(done.last_use)
        self.alias, self.transient = dict(done.alias), list(done.transient)
        self.transient_kinds = dict(done.transient_kinds)
        self.forwards, self.running = list(done.forwards), dict(done.running)
        for number, op in enumerate(op_table.forward_order(self.model), start=1):
            if op in self.model.loops:
                self.step = number  # the step the loop ran at
                self._loop_forward(op, self.model.loops[op], ("fwd",))
        self.step = done.step

    def _forward(self, op, source, where):
        """Runs `op` (an original or a copy): allocates its outputs, reads its inputs."""
        self.step += 1
        self.running[self.step] = ("forward" if where == ("fwd",) else "recompute", op,
                                   self.phase)
        row = self.rows[op]
        self._use_all(map(source, row.inputs))
        if where != ("fwd",) and op in self.model.loops and self._reuses_forward(op):
            for o in row.outputs:  # the copy is the forward run's outputs
                self._alloc(where + (o,), 0)
                self.alias[where + (o,)] = ("fwd", o)
            return
        scratch = self.model.run_workspace.get(op, 0)
        if where != ("fwd",):  # a copy may run another way (a scratch-free transposed conv)
            scratch = self.model.recompute_workspace.get(op, scratch)
        self._scratch(scratch)
        for o in row.outputs:
            aliased = self._shared_input(row, o, source, where)
            self._alloc(where + (o,), 0 if aliased else self.tensors[o].bytes)
            if aliased:
                self.alias[where + (o,)] = aliased
            elif o in row.forwards:
                read = [source(t) for t in row.inputs]
                self.forwards.append((self.step, where + (o,), self._held_once(
                    [source(t) for t in row.forwards[o]], read)))
            if o in self.ys:  # returned or differentiated last, with any buffer it shares
                key = where + (o,)
                while key is not None:
                    self.last_use[key] = _END
                    key = self.alias.get(key)
        if op in self.model.loops and where != ("fwd",):  # originals: `_forward_pass`
            self._loop_forward(op, self.model.loops[op], where)

    def _shared_input(self, row, output, source, where):
        """Key of the buffer `output` is, an input's or an identical op's
        made before in the same pass (None: a buffer of its own)."""
        shared = self.model.shared_buffers.get(output)
        if shared is not None:
            return source(shared)
        twin = self.model.merged.get(output)
        if twin is not None and source(twin)[:-1] == where and source(twin) in self.born:
            return source(twin)
        return source(row.inputs[0]) if row.inputs and row.op_type in ALIASING_OP_TYPES else None

    def _level(self, number, level, kept_roots):
        """One level: its copies that are needed, then the gradients of its ops."""
        model = self.model
        self.phase = number
        running = _needed_copies(model, level.copy_ops)
        where = ("copy", number)
        local = set(o for op in running for o in model.op_outputs[op])

        def source(t):
            return where + (t,) if t in local else ("fwd", t)

        def rerun(op):
            self._forward(op, source, where)
            if op not in model.loops or not self._reuses_forward(op):
                self.recompute_flops += self.rows[op].cost

        later = self._reruns_in_turn(running)
        for op in running:
            if op not in later:
                rerun(op)
        self.largest_level_bytes = max(self.largest_level_bytes, model.bytes_of(local))
        self._backward(level.copy_ops, {op: source for op in level.copy_ops}, leaves_ordered=True,
                       rerun_first={op: rerun for op in later})
        # Roots that cannot be recomputed are differentiated after the copies.
        roots = [model.op_of(c) for c in level.checkpoints if model.op_of(c) in kept_roots]
        self._backward(list(dict.fromkeys(roots)), {})

    def _reruns_in_turn(self, running):
        """The loops among a level's `running` copies that rerun only once the
        chain differentiated before theirs is done (tfgraph/loop_rerun.py,
        `start_reruns_in_turn`): chains of two chunks or more that no other
        copy reads, but the first differentiated (the last in `running`)."""
        loops, rows = self.model.loops, self.rows
        read = {t for op in running for t in rows[op].inputs}
        chains = [op for op in running if op in loops and self._chunked(op, loops[op])
                  and not loops[op].states_saved_when_recomputed
                  and loop_chunking.trips(loops[op]) > loops[op].chunk_size
                  and read.isdisjoint(rows[op].outputs)]
        return frozenset(chains[:-1])

    def _backward(self, ops, sources, leaves_ordered=False, rerun_first=None):
        """Runs the gradients of `ops` (topological order) in reverse order.

        `leaves_ordered`: a level's gradients, whose leaf gradients (a filter
        gradient's chain among them) run before backprop leaves their block
        (tfgraph/leaf_order.py), so nothing trails beside the gradients below.
        `rerun_first`: op -> a call recomputing it, made just before its gradient.
        """
        rerun_first = rerun_first or {}
        model = self.model
        # Looked up once per call: this loop runs for every op of every replay.
        rows, pending, born, last_use = self.rows, self.pending, self.born, self.last_use
        forward_keys = op_table.per_model(model, "forward_keys", _forward_keys)
        # The rewrite's means keep their gradients small; stock's are full-size.
        small_grads = model.small_grads if self.planned else {}
        trailing = ((), 0)  # keys read and scratch of a gradient part still running
        for op in reversed(ops):
            if op in rerun_first:
                rerun_first[op](op)
            self.step += 1
            self.running[self.step] = ("gradient", op, self.phase)
            row = rows[op]
            source = sources.get(op)
            # Output -> its gradient, if that came in one piece (then passed on, or
            # written over, as one buffer).
            whole = {o: pending[o][0] for o in row.outputs if len(pending.get(o, ())) == 1}
            passed = {t: whole[o] for t, o in row.passed if o in whole}
            incoming = [key for o in row.outputs for key in pending.pop(o, ())]
            if not incoming and self.ys.isdisjoint(row.outputs):
                continue  # no gradient reaches it: tf.gradients builds none
            read = incoming + list(map(source or forward_keys.__getitem__, row.reads))
            # A chain still running meets this gradient, the next chain's too.
            self._use_all(read)
            self._use_all(trailing[0])
            self._scratch(trailing[1])
            self.trailing_keys = frozenset(trailing[0])  # not written over while read
            if self.planned and not leaves_ordered and op in model.trailing_workspace:
                trailing = (read, model.trailing_workspace[op])
            if source is None:  # an original: its forward-only parts ran with it
                source = _original
                self._held_since_forward(op, row)
            self._gradient_scratch(op, row, whole, source)
            if op in model.loops:
                self._loop_backward(op, model.loops[op], source(row.outputs[0])[:-1])
            weights_first = self.planned and op in model.weights_first
            if weights_first:
                self._weight_gradient(op)
                self.step += 1  # the input gradient: after what only the weights' read is free
                self.running[self.step] = ("gradient", op, self.phase)
                self._use_all(incoming)
                self._scratch(self.workspace.get(op, 0))  # either kernel's: the larger
            step = self.step
            small = small_grads.get(op)
            for t, size in row.grads:  # `_alloc`, inlined
                key = ("grad", op, t)
                if t in passed:
                    born[key] = (step, 0)
                    self.alias[key] = passed[t]
                else:
                    born[key] = (step, size if small is None else small)
                    forwards = row.grad_forwards if self.planned else row.stock_grad_forwards
                    if t in forwards and small is None:
                        self._may_forward(key, forwards[t], whole, source)
                last_use.setdefault(key, step)
                pending.setdefault(t, []).append(key)
            if not weights_first:
                self._weight_gradient(op)

    def _weight_gradient(self, op):
        """Allocates `op`'s weight gradient, alive to the end: it is returned,
        unless it is a part of a weight's (`GraphModel.weight_sums`), added up
        with the others made once the backward pass is replayed (`_add_up_weight_parts`)."""
        weights = self.model.weight_grad_bytes.get(op, 0)
        if not weights:
            return
        key = ("weights", op)
        self._alloc(key, weights)
        self.last_use[key] = _END
        summed = self.model.weight_sums.get(op)
        if summed is None:
            self.weight_keys.add(key)
        else:
            self.weight_parts.setdefault(summed, []).append((op, key, self.step, self.phase))

    def _add_up_weight_parts(self):
        """Each weight's parts, as TensorFlow adds them (`_add_up`); in our
        rewrite, where it adds them as they are made (`WeightSum.as_made`, dense
        parts), those of each tf.gradients call to each read first, then
        those sums in turn into the first one's buffer (AddN writes over its
        first input), each other freed once added."""
        for summed, made in self.weight_parts.items():
            if not (self.planned and summed.as_made and not summed.sparse):
                self.weight_keys.add(self._add_up(summed, made))
                continue
            reads = dict(zip(summed.parts, summed.reads))
            calls = {}  # (phase, read) -> parts: the call from the ys sums at the weight
            for part in made:
                op, _, _, phase = part
                calls.setdefault((phase, None if phase == "tail" else reads[op]), []).append(part)
            sums = sorted(((max(step for *_, step, _ in parts), self._add_up(summed, parts))
                           for parts in calls.values()), key=lambda pair: pair[0])
            for end, added in sums[1:]:
                self.last_use[added] = end
            self.weight_keys.add(sums[0][1])

    def _add_up(self, summed, made):
        """The key of the sum of `made` (parts of `summed`), as tf.gradients adds
        them: all held until the last made (a part whose op gets no gradient is
        never made), IndexedSlices beside a dense part made dense as they come,
        then AddN over one of them (measured: the rows made dense where there
        are any, else the first part made), the others freed; parts all sparse
        are concatenated into a new buffer."""
        if len(made) == 1:
            return made[0][1]
        end = max(step for *_, step, _ in made)
        parts = [key for _, key, *_ in made]
        if all(op in summed.sparse for op, *_ in made):
            total = ("weights", summed.weight)
            self.born[total] = (end, sum(self.born[key][1] for key in parts))
            self.last_use[total] = _END
        else:
            densified = []
            for op, key, step, _ in made:
                if op in summed.sparse:
                    self.last_use[key] = step  # the rows, read once
                    densified.append(("dense", op))
                    self.born[densified[-1]] = (step, summed.bytes)
                    self.last_use[densified[-1]] = _END
            parts += densified
            total = densified[0] if densified else parts[0]
            parts.remove(total)
        for key in parts:
            if self.last_use[key] == _END:
                self.last_use[key] = end
        return total

    def _backward_parts(self, parts):
        """Stock backprop in the executor's order: (op, part) from `stock_order.parts`.

        A data part reads the op's output gradients only (a MatMul's or a
        convolution's input gradient reads the weights, not activations); the
        weight part reads them and the activations, and makes the weight
        gradient. Each keeps the output gradients alive until it has run.
        """
        model, rows, pending = self.model, self.rows, self.pending
        forward_keys = op_table.per_model(model, "forward_keys", _forward_keys)
        held = {}  # op -> its output gradients' keys, for its part still to run
        for op, part in parts:
            self.step += 1
            row = rows[op]
            if op not in held:
                held[op] = self._summed(row.outputs)
            read = list(held[op].values())
            if part != stock_order.DATA:
                read = read + [forward_keys[t] for t in row.reads]
            self._use_all(read)
            if part != stock_order.WEIGHTS:
                self._held_since_forward(op, row)
                self._gradient_scratch(op, row, held[op], _original)
                if op in model.loops:
                    self._loop_backward(op, model.loops[op], ("fwd",))
                # A BiasAdd passes its output gradient on as its input's: one buffer.
                passed = {t: held[op][o] for t, o in row.passed if o in held[op]}
                for t, size in row.grads:
                    key = ("grad", op, t)
                    if t in passed:
                        self._alloc(key, 0)
                        self.alias[key] = passed[t]
                    else:
                        self._alloc(key, size)
                        if t in row.stock_grad_forwards:
                            self._may_forward(key, row.stock_grad_forwards[t], held[op],
                                              _original)
                    pending.setdefault(t, []).append(key)
            if part != stock_order.DATA:
                self._weight_gradient(op)

    def _summed(self, outputs):
        """Output -> the key of its gradient, for the outputs of `outputs` that get
        one, the parts of one summed first (AddN): a gradient part that waits
        holds the sum, not the parts."""
        keys = {}
        for o in outputs:
            found = self.pending.pop(o, ())
            if len(found) > 1:
                self._use_all(found)
                self._alloc(("sum", o), self.tensors[o].bytes)
                self.forwards.append((self.step, ("sum", o), self._held_once(found, found)))
                found = [("sum", o)]
            if found:
                keys[o] = found[0]
        return keys

    def _may_forward(self, key, candidates, grads, source):
        """Records that the gradient `key` may be written over one of `candidates`
        (`OpRow.grad_forwards`): an output's incoming gradient (`grads`: output
        -> its key, where it came in one piece) or a tensor `source` names."""
        keys = [k for k in (self._candidate_key(c, grads, source) for c in candidates)
                if k is not None]
        self.forwards.append((self.step, key, self._held_once(keys, keys)))

    def _candidate_key(self, candidate, grads, source):
        """The buffer key of a ("grad" | "value", name) candidate, as in `_may_forward`;
        None where it has none, or a trailing gradient part still reads it."""
        kind, name = candidate
        key = grads.get(name) if kind == "grad" else source(name)
        return None if key in self.trailing_keys else key

    def _gradient_scratch(self, op, row, grads, source):
        """The scratch of `op`'s gradient in this step, recorded as shrinking
        where a candidate of `row.scratch_forwards` dies here (`grads` and
        `source` name the candidates, as in `_may_forward`)."""
        size = self.workspace.get(op, 0)
        self._scratch(size)
        savings = row.scratch_forwards if self.planned else row.stock_scratch_forwards
        if size and savings:
            options = [(key, saved) for key, saved in (
                (self._candidate_key(candidate, grads, source), saved)
                for candidate, saved in savings) if key is not None]
            self.scratch_forwards.append((self.step, len(self.transient) - 1, options))

    def _held_once(self, candidates, read):
        """The `candidates` whose buffer no other key of `read` (what the
        kernel reads) shares: a buffer read twice (`x + reshape(x)`) is held
        twice, and TensorFlow never writes over it."""
        roots = [self._root(k) for k in read]
        return [k for k in candidates if roots.count(self._root(k)) <= 1]

    def _root(self, key):
        """The key whose buffer `key` is (through aliases known so far)."""
        while key in self.alias:
            key = self.alias[key]
        return key

    def _take_forwarded_buffers(self):
        """Lets each result recorded in `forwards` take a buffer it may write
        over, then each scratch in `scratch_forwards` shrink.

        TensorFlow's element-wise kernels write their result over an input of
        the same shape and dtype when nothing else holds that input's buffer
        (`forward_input_or_allocate_output`): when no later op reads it. That
        is known once the replay is done, so it is applied here, in step
        order: a result takes the first candidate whose buffer is last read
        in its step, has its size and no other result of the step took; the
        result then allocates nothing and the buffer lives as long as it. A
        gradient's scratch then shrinks by the most one candidate left dying
        in its step saves.
        """
        born, last_use, alias = self.born, self.last_use, self.alias
        taken = {}  # step -> roots written over in it
        for step, key, candidates in self.forwards:  # recorded in step order
            root = self._dying_root(candidates, step, born[key][1], taken)
            if root is not None:
                alias[key] = root
                born[key] = (born[key][0], 0)
                end = last_use[key]
                last_use[root] = end if end == _END else max(end, step)
        for step, index, options in self.scratch_forwards:
            for candidate, saved in sorted(options, key=lambda option: -option[1]):
                if self._dying_root([candidate], step, None, taken) is not None:
                    self.transient[index] = (step, max(self.transient[index][1] - saved, 0))
                    break

    def _dying_root(self, candidates, step, size, taken):
        """The buffer of the first of `candidates` last read in `step`, of
        `size` bytes (None: any), not yet in `taken[step]` (then added); or None."""
        for candidate in candidates:
            root = self._root(candidate)
            if (root in taken.get(step, ()) or self.last_use.get(root) != step
                    or (size is not None and self.born[root][1] != size)
                    or not self._forwardable(root)):
                continue
            taken.setdefault(step, set()).add(root)
            return root
        return None

    def _forwardable(self, key):
        """Whether `key` is a buffer of a tensor or gradient the step allocates
        (not a loop's, whose outputs TensorFlow may hold elsewhere)."""
        if key[0] not in _FORWARDABLE_KINDS:
            return False
        tensor = self.tensors.get(key[-1])
        return key[0] in ("grad", "sum") or tensor is None or tensor.op not in self.model.loops

    def _held_since_forward(self, op, row):
        """The op's early gradient parts (`model.early_workspace`): alive from its
        forward step until the step before its gradient (then in its scratch)."""
        size = self.model.early_workspace.get(op, 0)
        if size:
            key = ("early", op)
            self.born[key] = (self.born[("fwd", row.outputs[0])][0], size)
            self.last_use[key] = self.step - 1

    def _scratch(self, size, kind="kernel"):
        """A buffer of `size` bytes alive during this step only: a kernel's
        scratch, or (`kind` "loop") what a loop's gradient reruns and rewrites."""
        if size:
            if kind != "kernel":
                self.transient_kinds[len(self.transient)] = kind
            self.transient.append((self.step, size))

    def _alloc(self, key, size):
        self.born[key] = (self.step, size)
        self.last_use.setdefault(key, self.step)

    def _use(self, key):
        self._use_all((key,))

    def _use_all(self, keys):
        """Reads the buffers `keys` (and those they alias) in this step."""
        last_use, alias, step = self.last_use, self.alias, self.step
        for key in keys:
            while key is not None:  # buffers are in `last_use` from their allocation on
                if last_use.get(key, _END) != _END:
                    last_use[key] = step
                key = alias.get(key)

    def _weight_grad_bytes(self):
        return sum(self.born[key][1] for key in self.weight_keys)

    def _peak(self):
        """Max over steps of the bytes alive."""
        return int(self._live().max())

    def _live(self, skip=frozenset()):
        """Bytes alive at each step (difference array, linear), buffers `skip` left out."""
        end = self.step + 2
        keys = [key for key in self.born if key not in skip] if skip else self.born
        count = len(keys)
        intervals = map(self.born.__getitem__, keys) if skip else self.born.values()
        born = np.fromiter(itertools.chain.from_iterable(intervals), np.int64,
                           2 * count).reshape(count, 2)
        starts, sizes = born[:, 0], born[:, 1]
        last_use = np.fromiter(map(self.last_use.__getitem__, keys), np.float64, count)
        stops = np.where(last_use == _END, end, last_use + 1).astype(np.int64)
        delta = np.zeros(end + 1, np.int64)
        np.add.at(delta, starts, sizes)
        np.add.at(delta, stops, -sizes)
        live = np.cumsum(delta[:end])
        for step, size in self.transient:
            live[step] += size
        return live


def _forward_pass_of(model):
    """A replay after the original ops ran, their loops left out (`_Replay._forward_pass`)."""
    replay = _Replay(model)
    for name, size in model.outside_bytes.items():  # made before the region's ops
        replay._alloc(_original(name), size)  # pylint: disable=protected-access
    for op in op_table.forward_order(model):
        replay._forward(op, _original, ("fwd",))  # pylint: disable=protected-access
    return replay


def _original(tensor):
    """The buffer key of a tensor of the forward pass (not of a copy)."""
    return ("fwd", tensor)


def _forward_keys(model):
    """Tensor name -> `_original(name)`, made once per model (replays read them often)."""
    return {name: ("fwd", name) for name in [*model.tensors, *model.outside_bytes]}


def _needed_copies(model, copy_ops):
    """The copies TensorFlow runs: those read by a needed copy or a level gradient.

    A copied matmul whose gradient reads only its inputs, and whose output no
    other copy reads, is pruned by TensorFlow and never runs. A copied loop
    always runs: its gradient reads what it keeps (stacks or chunk states).
    """
    rows, loops = op_table.rows(model), model.loops
    read = set()
    for op in copy_ops:
        read.update(rows[op].reads)
    needed = []
    for op in reversed(copy_ops):
        row = rows[op]
        if op in loops or not read.isdisjoint(row.outputs):
            needed.append(op)
            # Inputs from outside the level are added too: no copy's output, never asked.
            read.update(row.inputs)
    return needed[::-1]
