"""The cut model: the planner's graph seen as cuts of one topological order.

No TensorFlow. Ops are numbered in a topological order. A *cut* at position p
separates ops 0..p from the ops after p; the tensors alive across it (made at
or before p, read after p) are kept as checkpoints. A set of cuts splits the
order into intervals; backprop walks them last to first:

* the *tail* (after the last cut) is differentiated from the forward pass's
  own tensors, as tf.gradients would;
* every other interval is recomputed from the checkpoints before it, so its
  ops that are not kept are run again, and their outputs are alive together.

Backprop frees a kept tensor once the intervals after it are done with it,
so while interval j is differentiated only the tensors kept across the cuts
up to j's own are alive. For cuts P with intervals I_0 .. I_k (I_k the tail),
K_j the bytes kept across I_j's closing cut (made in I_j, read after it), S_j
the bytes I_j recomputes that backprop holds (those some gradient reads; the
others are freed as the recomputation moves on; the tail: its forward bytes
that backprop holds), W_j the bytes I_j's gradients send to weights, and fixed
the bytes always kept (pinned: stateful or control flow; and the ys):

    peak(P)      = fixed + max over j of (K_0 - W_0 + ... + K_j - W_j + S_j)
    recompute(P) = cost of the ops recomputed, summed over the intervals
                   (and the tail's ops that pinned tensors are rebuilt from, below)

(K_k = W_k = 0: nothing is kept across the tail, and its weight gradients
are made while it is differentiated.) The peak is, like the timeline's, the
step's peak less every weight gradient it returns: while I_j is
differentiated, the weight gradients of the intervals after it are made and
alive to the end of the step, those of I_0 .. I_j are not yet, so keeping a
tensor costs less the earlier in backprop it is freed (a chain's top
intervals are differentiated beside few weight gradients, its bottom ones
beside nearly all). Intervals near the start may be
longer than those near the end, which are differentiated while every earlier
checkpoint is still held: on a chain of n equal ops the best plan shrinks its
intervals by one op per cut, about sqrt(2n) tensors at the peak, not 2 sqrt(n).

Pinned tensors that are recomputable (the activation inputs of a stateful
op, a random op, control flow or a nested call that cannot be rerun) are
kept, and each one's level rebuilds it from the checkpoints before it
whatever else is kept: their ancestors (`CutProblem.op_rerun`) are
recomputed even when a plan leaves them in the tail, where a plain tail's
ops are not. Counted as free, a plan with few cuts looked as if it
recomputed nothing, and budgets returned the least-peak plan however large
(ConvNeXtTiny's 18 nested depthwise-convolution calls). Their held bytes
stay counted in the tail (the forward pass holds them until those levels
have passed): an overestimate.

Every graph has such cuts, with or without single-tensor bottlenecks. Both
terms decompose over consecutive cuts (the peak as a running sum under a
max), which is what lets `solvers` search the plans exactly. `evaluate` is the definition; the solvers must agree with it.
"""

import dataclasses

import numpy as np

from memory_saving_gradients.core import op_table
from memory_saving_gradients.core import timeline
from memory_saving_gradients.core.model import GraphModel


@dataclasses.dataclass(frozen=True)
class CutProblem:
    """Ops in topological order, as arrays indexed by position.

    Attributes:
      ops: op names in order.
      op_bytes: activation bytes each op outputs.
      op_cost: cost (FLOPs) of rerunning each op.
      op_held: of op_bytes, the bytes some gradient reads: what stays alive
        of a recomputed (or tail) op until backprop has passed it.
      last_use: position of each op's last reader; len(ops) if it is alive
        to the end (a y).
      always_kept: ops whose outputs are kept whatever the cuts (pinned, ys).
      cuts: candidate cut positions, ascending; a cut at p lies after op p.
      op_weights: bytes each op's gradient sends to weights (alive from then
        to the end of the step).
      op_rerun: ops recomputed even in the tail: the ancestors of recomputable
        pinned tensors (up to the next pinned ones), which their levels rebuild.
    """
    ops: tuple
    op_bytes: np.ndarray
    op_cost: np.ndarray
    last_use: np.ndarray
    always_kept: np.ndarray
    cuts: np.ndarray
    op_held: np.ndarray
    op_weights: np.ndarray
    op_rerun: np.ndarray

    @property
    def fixed_bytes(self) -> int:
        """Bytes kept whatever the plan."""
        return int(self.op_bytes[self.always_kept].sum())

    @property
    def baseline_bytes(self) -> int:
        """Peak with no cut: what backprop holds of every activation, as with tf.gradients."""
        return self.fixed_bytes + int(self.op_held[~self.always_kept].sum())


def from_model(model: GraphModel, max_cuts=None, cut_after=None) -> CutProblem:
    """The cut problem of a core GraphModel (one entry per op of
    `model.forward_order`: a cut separates what the forward pass has run).

    `max_cuts` limits the candidate cuts (all op boundaries when None): the
    order is split into that many windows of equal activation bytes, and the
    cheapest position of each (fewest bytes alive across it) is a candidate.
    `cut_after(op_type)`: ops after which a cut is always a candidate.
    """
    tensors = model.tensors
    ops = op_table.forward_order(model)
    position = {op: i for i, op in enumerate(ops)}
    end = len(ops)
    op_bytes = np.zeros(end, np.int64)
    op_cost = np.zeros(end, np.float64)
    last_use = np.arange(end, dtype=np.int64)
    op_held = np.zeros(end, np.int64)
    op_weights = np.array([model.weight_grad_bytes.get(op, 0) for op in ops], np.int64)
    always = np.zeros(end, bool)
    ys, pinned = set(model.ys), model.pinned
    held = {t for op in ops for t in timeline.gradient_reads(model, op)}
    for name in model.order:
        i = position[tensors[name].op]
        op_bytes[i] += tensors[name].bytes
        op_held[i] += tensors[name].bytes if name in held or name in ys else 0
        op_cost[i] = tensors[name].cost
        readers = [position[tensors[s].op] for s in model.graph.successors(name)]
        last_use[i] = max([last_use[i], *readers, end if name in ys else 0])
        always[i] |= name in pinned or name in ys
    rerun = [position[tensors[t].op] for t in rerun_by_pinned(model)]
    problem = make_problem(ops, op_bytes, op_cost, last_use, always, max_cuts, op_held,
                           op_weights, np.isin(np.arange(end), rerun))
    if cut_after is None:
        return problem
    wanted = [i for i, op in enumerate(ops[:-1])
              if cut_after(tensors[model.op_outputs[op][0]].op_type)]
    return dataclasses.replace(problem, cuts=np.union1d(problem.cuts, wanted).astype(np.int64))


def with_activations_scaled(problem: CutProblem, factor: int) -> CutProblem:
    """`problem` with every activation `factor` times its bytes and the weight
    gradients as they are: the problem of a batch `factor` times larger, whose
    least-peak cuts keep less of the activations where the weight gradients
    outweigh them at the traced batch (and set every plan's peak alike)."""
    if factor == 1:
        return problem
    return dataclasses.replace(problem, op_bytes=problem.op_bytes * factor,
                               op_held=problem.op_held * factor)


def rerun_by_pinned(model: GraphModel, kept_loops=frozenset()) -> set:
    """Activations a plan recomputes whatever it keeps: those a recomputable pinned
    tensor is rebuilt from, back to the nearest pinned ones (`planning.segment`). O(n).

    `kept_loops`: loops the plan differentiates where they are
    (`planning.LoopModes`): their outputs are kept and not rebuilt."""
    tensors, graph = model.tensors, model.graph
    pinned = model.pinned | {t for op in kept_loops for t in model.op_outputs[op]}
    found = set()
    stack = [t for t in pinned if tensors[t].recomputable and tensors[t].op not in kept_loops]
    while stack:
        for p in graph.predecessors(stack.pop()):
            if p not in pinned and p not in found:
                found.add(p)
                stack.append(p)
    return found


def make_problem(ops, op_bytes, op_cost, last_use, always_kept, max_cuts=None,
                 op_held=None, op_weights=None, op_rerun=None) -> CutProblem:
    """A CutProblem from plain sequences; candidate cuts as in `from_model`.

    `op_held` defaults to `op_bytes` (every output read by a gradient),
    `op_weights` to zeros (no weight gradients), `op_rerun` to none."""
    op_bytes = np.asarray(op_bytes, np.int64)
    op_weights = np.zeros(len(ops), np.int64) if op_weights is None else np.asarray(
        op_weights, np.int64)
    op_held = op_bytes if op_held is None else np.asarray(op_held, np.int64)
    last_use = np.asarray(last_use, np.int64)
    always_kept = np.asarray(always_kept, bool)
    positions = np.arange(max(len(ops) - 1, 0))
    if max_cuts is not None and len(positions) > max_cuts:
        positions = _cheapest_cuts(op_bytes, last_use, always_kept, max_cuts)
    op_rerun = np.zeros(len(ops), bool) if op_rerun is None else np.asarray(op_rerun, bool)
    return CutProblem(tuple(ops), op_bytes, np.asarray(op_cost, np.float64), last_use,
                      always_kept, positions, op_held, op_weights, op_rerun & ~always_kept)


def live_bytes(op_bytes, last_use, always_kept):
    """Bytes alive across each cut position (not counting always-kept ops). O(n)."""
    end = len(op_bytes)
    delta = np.zeros(end + 1, np.int64)
    free = np.where(always_kept, 0, op_bytes)
    np.add.at(delta, np.arange(end), free)
    np.add.at(delta, np.minimum(last_use, end), -free)
    return np.cumsum(delta)[:max(end - 1, 0)]


def _cheapest_cuts(op_bytes, last_use, always_kept, count):
    """The cheapest cut in each of `count` windows of equal activation bytes."""
    live = live_bytes(op_bytes, last_use, always_kept)
    made = np.cumsum(np.maximum(op_bytes, 1))[:len(live)]
    window = np.minimum((made * count) // (made[-1] + 1), count - 1)
    starts = np.flatnonzero(np.diff(window, prepend=-1))
    return np.array([s + int(np.argmin(part)) for s, part in
                     zip(starts, np.split(live, starts[1:]))], np.int64)


@dataclasses.dataclass(frozen=True)
class Cost:
    """What the cut model predicts for one set of cuts."""
    kept_ops: frozenset
    peak_bytes: int
    recompute: float


def evaluate(problem: CutProblem, cuts) -> Cost:
    """The cut model's peak and recompute for `cuts` (positions), by definition.

    Direct and O(n log n): the reference the solvers are tested against.
    """
    cuts = np.unique(np.asarray(cuts, np.int64))
    end = len(problem.ops)
    pos = np.arange(end)
    free = ~problem.always_kept
    # The first cut at or after each op closes its interval (len(cuts): tail).
    closing = np.searchsorted(cuts, pos, side="left")
    closes_at = np.append(cuts, end)[closing]
    kept = free & (closing < len(cuts)) & (problem.last_use > closes_at)
    recomputed = free & ~kept & (closing < len(cuts))
    tail = free & (closing == len(cuts))
    per_interval = len(cuts) + 1
    weights = np.bincount(closing, problem.op_weights, minlength=per_interval)
    weights[-1] = 0  # the tail's weight gradients are made while it runs
    held = np.cumsum(np.bincount(closing[kept], problem.op_bytes[kept], minlength=per_interval)
                     - weights)
    # An interval's own weight gradients are made while it is differentiated:
    # beside its recomputed bytes they are not yet counted as made.
    segments = np.bincount(closing[recomputed], problem.op_held[recomputed],
                           minlength=per_interval) + weights
    segments[-1] = problem.op_held[tail].sum()
    peak = problem.fixed_bytes + int((held + segments).max())
    recomputed |= tail & problem.op_rerun
    return Cost(kept_ops=frozenset(problem.ops[i] for i in np.flatnonzero(kept)),
                peak_bytes=peak, recompute=float(problem.op_cost[recomputed].sum()))
