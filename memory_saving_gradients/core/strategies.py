"""Strategies: which activations to keep. One registry, one result type.

A strategy is a callable ``strategy(model) -> Result`` (or returning tensor
names, which the registry turns into a Result); it knows nothing of
TensorFlow. `run` resolves what a user passed as ``checkpoints=``:

* 'memory': the plan of least predicted peak over cuts of a topological
  order (the cut model's best plans, `cuts`, `solvers`, priced by the
  timeline); among plans of that predicted peak, the least peak by the step's
  other count (weight gradients held or taken as made), then the least
  recompute.
* 'speed': the same, recomputing only cheap ops (never a matmul,
  convolution or einsum), so at most one extra forward pass of cheap ops.
  Both are tf.gradients itself (`stock`) when no plan is predicted below it.
* a sequence of tensor names: keep exactly those ('list', 'collection').
* any other callable: a custom strategy receiving the GraphModel and
  returning the names of the tensors to keep, or a Result
  (`budgets.Budget` and `budgets.MemoryWithin` are such).
"""

import collections.abc
import dataclasses
import functools
import logging
from typing import Optional

import numpy as np

from memory_saving_gradients.core import collector
from memory_saving_gradients.core import cuts
from memory_saving_gradients.core import loop_plans
from memory_saving_gradients.core import op_table
from memory_saving_gradients.core import planning
from memory_saving_gradients.core import pricing
from memory_saving_gradients.core import solvers
from memory_saving_gradients.core.model import (UNKNOWN_DIM_CHOICE_SCALE, UNKNOWN_DIM_SIZE,
                                                 GraphModel)

logger = logging.getLogger(__name__)

EXPENSIVE_OP_TYPES = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "Conv", "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
    "Conv3DBackpropInputV2", "_FusedMatMul", "_FusedConv2D",
})
MAX_CUTS = 128  # candidate cuts on large graphs (all op boundaries below that)
CANDIDATE_PLANS = 6  # of the cut model, priced by the timeline
# The cut model's candidates are also chosen as for batches these many times the
# traced one (`low_peak_candidates`): the more the weight gradients outweigh the
# activations, the larger the batch whose plans keep few activations.
LARGER_BATCHES = (4, 16)
MAX_PRICED = 64  # plans whose prices are remembered per model (a strategy prices about 20)
MAX_STAIRS = 64  # plans per loop setting `staircase` walks down
FIT_RETRIES = 4  # re-solves with a tighter cut-model budget when the prediction overshoots
# 'memory' and 'speed' leave the gradient to tf.gradients when no plan is
# predicted below its peak. False: always rewrite (to see the rewrite at work
# on a toy graph whose plans save nothing; the test suite does, see conftest).
STOCK_FALLBACK = True

# The two counts of a step's peak that `_chosen` ranks and guards by. Neither is
# the step's exactly: Keras 3's optimizer puts one IdentityN over every weight
# gradient, but Grappler's dependency optimizer removes it in a step that returns
# a value (`fit`'s does), so each update waits for its own gradient alone, and the
# executor's order keeps two or three alive at once, not all (docs/planner.md,
# session 53).
HELD, AS_TAKEN = "held", "as taken"
_COUNTED = {HELD: "with the weights' gradients held",
            AS_TAKEN: "where an optimizer in the same graph takes each weight gradient as it "
                      "is made"}


@dataclasses.dataclass(frozen=True)
class Result:
    """What every strategy returns.

    Attributes:
      strategy: its name ('memory', 'speed', 'list', 'budget(...)', ...).
      chosen: tensor names it chose to keep (whole ops, without pinned ones).
      feasible: False when the strategy could not meet its own target.
      notes: what was chosen and why, in words.
      plan: the plan built from `chosen` (what the rewrite executes).
      estimate: `pricing.predict` of that plan.
    """
    strategy: str
    chosen: tuple
    feasible: bool
    notes: tuple
    plan: planning.Plan = dataclasses.field(repr=False)
    estimate: pricing.timeline.Estimate

    @property
    def peak_bytes(self) -> int:
        return self.estimate.peak_bytes

    @property
    def recompute_flops(self) -> int:
        return self.estimate.recompute_flops


def result_of(model: GraphModel, names, strategy, notes=(), feasible=True,
              loops=planning.LoopModes()) -> Result:
    """Plans and prices keeping `names` (and the loops `loops` keeps): the
    common end of every strategy."""
    plan, estimate = _priced(model, frozenset(names), loops)
    notes = tuple(notes) + loop_plans.describe(loops)
    plan = dataclasses.replace(plan, strategy=strategy, notes=notes)
    return Result(strategy=strategy, chosen=plan.chosen, feasible=feasible,
                  notes=tuple(notes), plan=plan, estimate=estimate)


def _priced(model, names, loops):
    """(plan, estimate) of keeping `names` under `loops`, once per model, set of
    names and loop modes: the searches meet the same plans more than once (a
    budget's first fit is often one of the least-peak candidates), and each
    costs a replay of the model."""
    seen = op_table.per_model(model, "priced", lambda _: {})
    key = names, loops
    if key not in seen:
        if len(seen) >= MAX_PRICED:
            seen.clear()
        plan = planning.make_plan(model, names, "", loops=loops)
        # Sets differing only in tensors kept anyway (pinned, split) make one plan.
        same = [e for p, e in seen.values() if (p.kept, p.loops) == (plan.kept, loops)]
        seen[key] = plan, same[0] if same else pricing.predict(model, plan)
    return seen[key]


def explicit(model: GraphModel, names, strategy="list") -> Result:
    """Keeps exactly those of `names` that are activations of `model`.

    The others are kept anyway or are not between xs and ys (weights, tensors
    of another `gradients` call's region in the collection): a note names them.
    """
    names = list(names)
    kept = {n for n in names if n in model.graph}
    ignored = sorted(set(names) - kept)
    notes = (f"{len(ignored)} of the given checkpoints are not activations between "
             f"xs and ys and were ignored (weights or tensors outside the region): "
             f"{', '.join(ignored[:5])}{' ...' if len(ignored) > 5 else ''}",) if ignored else ()
    return result_of(model, kept, strategy, notes)


def memory(model: GraphModel, problem=None) -> Result:
    """The least predicted peak; among plans of that peak, the least peak by the
    other count (`_rank_key`), then the least recompute.

    The cut model's least-peak plans often recompute more than another plan
    the timeline prices at the same peak, so that one is searched for too,
    under the loop modes the least-peak plan chose.
    `problem` is `cut_problem(model)`, built here when not given.

    The peak is the step's with every weight gradient held to the end, or,
    for a model whose `weight_gradients_taken` (Keras 3's own `fit` step),
    with each taken as it is made (`pricing.activation_peak`): Grappler lets
    each update there wait for its own gradient alone (see HELD), and measured
    under `fit` the plan ranked first by that count peaked 9-12% lower on
    EfficientNetV2B0 (benchmarks/plan_objectives.py). The other count guards
    (`_chosen`).

    The plan found so from the cut model's plans at the traced sizes is
    then bettered, where it can be, from its plans chosen as for a larger
    batch (`_lower_by_both`), searched the same way.

    Example: on a 100-layer tanh chain it keeps about 10 tensors, spaced so the
    recomputed segments and the kept tensors are balanced.
    """
    problem = problem or cut_problem(model)
    return _bettered_by_larger(model, problem, model.weight_gradients_taken,
                               functools.partial(_cheapest_at_peak, model, problem))


def _cheapest_at_peak(model, problem, least, instead) -> Result:
    """`memory`'s search from `_chosen`'s (least, instead): the plan recomputing
    least at `least`'s peak and no higher by either count, or `least`."""
    if least.plan.stock:  # nothing recomputes less
        return least
    taken = model.weight_gradients_taken
    ranks, guards = _counts(taken)
    peak = _as_taken(model) if taken else _requested
    modes = least.plan.loops
    cheaper = _fitting(model, loop_plans.adjusted(problem, model, modes), peak(least),
                       "memory", modes, _no_more_than(model, least, ranks, guards))
    if cheaper is None or cheaper.recompute_flops >= least.recompute_flops:
        return _ranked_note(model, least)
    if STOCK_FALLBACK and not _guard_passes(  # as `_chosen` checks `least`
            model, cheaper, guards, _stock_peak(model, cheaper, guards)):
        return _ranked_note(model, least)
    at = ("the least predicted peak" if instead is None else
          "the predicted peak of the plan taken instead of the least-peak one")
    return _ranked_note(model, dataclasses.replace(cheaper, notes=cheaper.notes + (
        f"least recompute at {at} ({peak(least) / 2**20:.1f} MiB, "
        f"{least.recompute_flops:.3g} FLOPs recomputed)",) + ((instead,) if instead else ())))


def _no_more_than(model, least, ranks, guards):
    """A judge for `_fitting` at `least`'s peak by the `ranks` count: a plan's
    peak by that count, or by the `guards` count shifted by `least`'s margin
    between the two, whichever is more. So a plan passes only where it peaks
    no higher than `least` by either count: where the weight gradients set
    the ranked peak at the end of the step, every plan ties there, and the
    one recomputing least would keep the most activations (InceptionV3 at
    64 px: 16.2 MiB of activations at its peak against 11.8, the whole step
    94.9 MiB either way), which is what a larger batch would pay for."""
    margin = counted_peak(model, least, ranks) - counted_peak(model, least, guards)
    return lambda result: max(counted_peak(model, result, ranks),
                              counted_peak(model, result, guards) + margin)


def _ranked_note(model: GraphModel, result: Result) -> Result:
    """`result`, saying which peak ranked it where that is not the default."""
    if not model.weight_gradients_taken or result.plan.stock:
        return result
    return dataclasses.replace(result, notes=result.notes + (
        f"plans ranked by the step's peak {_COUNTED[AS_TAKEN]} "
        f"({pricing.activation_peak(model, result.plan) / 2**20:.1f} MiB; tf.gradients' "
        f"{pricing.activation_peak(model, None) / 2**20:.1f})",))


def least_peak(model: GraphModel, problem=None) -> Result:
    """Keeps the tensors alive across the cuts of least predicted peak (ties:
    `_rank_key`), each loop rerun by its level or kept in chunks, whichever
    the timeline prices lower (`low_peak_candidates`); tf.gradients itself when
    none is predicted below it.

    `problem` is `cut_problem(model)`, built here when not given (callers that
    go on to `fitting_plan` pass theirs so it is built once).
    """
    problem = problem or cut_problem(model)
    return _bettered_by_larger(model, problem, False, lambda least, _instead: least)


def _bettered_by_larger(model, problem, taken, search) -> Result:
    """`search` (a function of `_chosen`'s (least, instead)) run from the plans
    chosen at the traced sizes, then, where `_lower_by_both` admits any against
    what it found, from the plans chosen as for a larger batch; `taken` as in
    `_chosen`."""
    traced, larger = _traced_and_larger(model, problem)
    result = search(*_chosen(model, "memory", traced, taken))
    admitted = _lower_by_both(model, result, larger, taken)
    return search(*_chosen(model, "memory", admitted, taken)) if admitted else result


def _lower_by_both(model, result, larger, taken) -> list:
    """Those of `larger` (plans chosen as for a larger batch) that peak no higher
    than `result` by both counts (`_no_more_than`) and rank before it
    (`_rank_key`), `taken` as in `_chosen`.

    Where the weight gradients outweigh the activations they set every plan's
    held peak alike, and the plans chosen at the traced sizes can keep a tail
    of activations the larger batch's do not (ResNet101 at 64 px, batch 8:
    0.56 of tf.gradients' activations measured, 0.43 so; its held peak 14.6
    MiB against 14.1). Ranked with the others unbounded, one tying by the
    ranked count at less recompute would be taken where it keeps more
    activations as taken (InceptionV3 at 64 px: 10% more). Judged against the
    traced sizes' final plan (`result`), not their least-peak one, a `memory`
    search from them is never above what it found without them by either
    count; so a plan lower by the ranked count and higher by the other is not
    taken (a random model ranked as taken: 108 MiB as taken and 102 held
    against the traced choice's 111 and 99)."""
    ranks, guards = _counts(taken)
    judge, bound = _no_more_than(model, result, ranks, guards), counted_peak(model, result, ranks)
    key = _rank_key(model, ranks, guards)
    return [r for r in larger if judge(r) <= bound and key(r) < key(result)]


def _counts(taken) -> tuple:
    """(the count that ranks plans, the count that guards them) (`_chosen`)."""
    return (AS_TAKEN, HELD) if taken else (HELD, AS_TAKEN)


def _rank_key(model, ranks, guards):
    """How `_chosen` orders plans: by the `ranks` count, then by the `guards`
    count, then by recompute. Where the weight gradients outweigh the
    activations, they set every plan's held peak alike at the end of the step,
    and that tie says nothing of the activations: broken by recompute, it took
    the plan keeping the most of them (ResNet152V2 at 64 px, batch 8: 64.5 MiB
    as taken against 21.2 at the same held peak), which is what a user growing
    the batch pays for."""
    return lambda r: (counted_peak(model, r, ranks), counted_peak(model, r, guards),
                      r.recompute_flops)


def fitting_plan(model: GraphModel, problem, max_bytes, name, peak=None) -> Optional[Result]:
    """The least-recompute plan whose peak (judged by `peak`, as in
    `least_peak`) is at most `max_bytes`, or None: `_fitting` under each way of
    differentiating the model's rerunnable loops (`loop_plans.settings`: rerun
    by their levels, or kept), the least predicted recompute of those that fit
    (ties: the first, loops rerun)."""
    found = [_fitting(model, loop_plans.adjusted(problem, model, modes), max_bytes, name, modes,
                      peak or _requested)
             for modes in loop_plans.settings(model)]
    return min((r for r in found if r is not None), key=lambda r: r.recompute_flops,
               default=None)


def staircase(model: GraphModel, problem, top, name) -> list:
    """Every plan `fitting_plan`'s search can start from at a budget of at most
    `top`: under each loop setting, the least-recompute plan under `top`, then
    under one byte less than that plan's cut-model peak, and so on down to the
    cut model's least peak (at most `MAX_STAIRS` plans a setting), priced."""
    found = []
    for modes in loop_plans.settings(model):
        adjusted, target = loop_plans.adjusted(problem, model, modes), top
        for _ in range(MAX_STAIRS):
            step = solvers.least_recompute(adjusted, target)
            if step is None:
                break
            found.append(result_of(model, tensors_of(model, step.cost.kept_ops), name,
                                   loops=modes))
            target = step.cost.peak_bytes - 1
    return found


def _fitting(model, problem, max_bytes, name, loops, peak=None) -> Optional[Result]:
    """The cut model's least-recompute plan under `loops` whose peak (`peak`
    of the Result, default bytes requested) is at most `max_bytes`, or None.
    The simulator sees more than the cut model: when a plan overshoots, the
    cut model's budget is lowered by the overshoot; when that would find the
    same plan again (its cut-model peak is often well under the budget that
    found it), to `max_bytes` less the excess of the judged peak over the cut
    model's on that plan. A plan over `max_bytes` in bytes requested is not
    judged further: every `peak` is at least that (a BFC allocator's chunks
    hold at least the bytes requested)."""
    peak = peak or _requested
    target = max_bytes
    for _ in range(FIT_RETRIES):
        found = solvers.least_recompute(problem, target)
        if found is None:
            return None
        tried = result_of(model, tensors_of(model, found.cost.kept_ops), name, loops=loops)
        judged = tried.peak_bytes if tried.peak_bytes > max_bytes else peak(tried)
        if judged <= max_bytes:
            return tried
        target -= judged - max_bytes
        if target >= found.cost.peak_bytes:
            target = max_bytes - (judged - found.cost.peak_bytes)
    return None


def _requested(result: Result) -> int:
    """A plan's predicted peak of bytes requested (the default judge)."""
    return result.peak_bytes


def with_allocator_peak(model: GraphModel, result: Result) -> Result:
    """`result` with the peak a BFC allocator reaches on its plan in its estimate
    (`pricing.with_allocator_peaks`; remembered per model and plan)."""
    if result.estimate.allocator_peak_bytes is not None:
        return result
    return dataclasses.replace(result, estimate=pricing.with_allocator_peaks(
        model, result.plan, result.estimate))


def allocator_peak(model: GraphModel, result: Result) -> int:
    """The peak a BFC allocator reaches on `result`'s plan, activation memory:
    what TensorFlow measures on GPUs and on CPU with TF_CPU_ALLOCATOR_USE_BFC=1."""
    return with_allocator_peak(model, result).estimate.allocator_peak_bytes


def speed(model: GraphModel) -> Result:
    """Least peak among the plans that recompute no matmul, convolution or einsum
    (ties: `_rank_key`).

    Each op is in one interval, so it is recomputed at most once; the plan
    with no cut (tf.gradients' own memory) is among those searched.
    """
    tensors = model.tensors
    # Right after an expensive op is where a plan keeps its output.
    problem = cuts.from_model(model, MAX_CUTS, EXPENSIVE_OP_TYPES.__contains__)
    expensive = np.array([tensors[model.op_outputs[op][0]].op_type in EXPENSIVE_OP_TYPES
                          for op in problem.ops], bool)
    return _chosen(model, "speed", _candidates(model, "speed", expensive, problem,
                                               (planning.LoopModes(),)))[0]


def cut_problem(model: GraphModel):
    return cuts.from_model(model, max_cuts=MAX_CUTS)


def _chosen(model, name, priced, taken=False) -> tuple:
    """(the plan of least predicted peak of `priced`, ties: the least peak by
    the other count, then the least recompute (`_rank_key`); None), or where
    that plan is not below tf.gradients by both counts (`counted_peak`; as
    taken, equal to it passes for the plan ranked first), (the next of them
    strictly below both, or tf.gradients itself; why).
    `taken`: the count with each weight gradient taken as it is made ranks,
    and the held count guards; else the other way round.

    The cut model counts every recomputed output as alive at once and sees no
    gradients nor scratch buffers; the timeline does, and ranks its few best
    plans (one per bound on the largest interval) differently.
    """
    ranks, guards = _counts(taken)

    def peak(result, count):
        return counted_peak(model, result, count)
    ranked = sorted(priced, key=_rank_key(model, ranks, guards))
    best = ranked[0]
    if not STOCK_FALLBACK:
        return best, None
    # A plan that saves nothing would still cost its recompute (and, with
    # hundreds of levels, minutes of graph building): a user asking for less
    # memory never gets more than tf.gradients' own (the timeline sees
    # gradients and scratch the cut model does not, so its best can be above).
    # Where the weight gradients outweigh the activations, every plan's held
    # peak is theirs at the end, and the least of such near ties can keep more
    # activations than stock earlier in backprop (12 dense layers of 512 units
    # on 128 rows under `fit`: 1.12-1.35x stock's step); the next of those that
    # is below stock by both counts is taken then.
    stock_peak = {count: _stock_peak(model, best, count) for count in (HELD, AS_TAKEN)}
    if peak(best, ranks) >= stock_peak[ranks]:
        why = (f"no plan was predicted below tf.gradients' peak of "
               f"{stock_peak[ranks] / 2**20:.1f} MiB {_COUNTED[ranks]} (the best of the cut "
               f"model's {len(priced)}: {peak(best, ranks) / 2**20:.1f} MiB)")
    elif _guard_passes(model, best, guards, stock_peak[guards]):
        return best, None
    else:
        # The margin, not the two peaks: where the weights' gradients dominate,
        # both print alike (0.25 MiB).
        below = (stock_peak[ranks] - peak(best, ranks)) / 2**10
        why = (f"the best plan ({below:.0f} KiB below tf.gradients' peak {_COUNTED[ranks]}) "
               f"was predicted above tf.gradients {_COUNTED[guards]} "
               f"({peak(best, guards) / 2**20:.1f} MiB against "
               f"{stock_peak[guards] / 2**20:.1f})")
        # Strictly below both: a plan only equal to stock by one count would add
        # recompute for nothing where that count is the one that matters.
        for other in ranked[1:]:
            if all(peak(other, count) < stock_peak[count] for count in stock_peak):
                why = (f"{why}; taken instead: the next of them below tf.gradients both ways "
                       f"({peak(other, ranks) / 2**20:.1f} MiB {_COUNTED[ranks]})")
                return dataclasses.replace(other, notes=other.notes + (why,)), why
    why = f"{why}: the stock gradient, every activation kept, nothing recomputed"
    return stock(model, name, (why,)), why


def counted_peak(model, result, count) -> int:
    """`result`'s predicted peak with every weight gradient held to the end
    (HELD) or with each taken as it is made (AS_TAKEN)."""
    return result.peak_bytes if count == HELD else pricing.activation_peak(model, result.plan)


def _stock_peak(model, result, count) -> int:
    """tf.gradients' predicted peak by `count` (`result`: any plan of `model`)."""
    return (result.estimate.baseline_bytes if count == HELD
            else pricing.activation_peak(model, None))


def _guard_passes(model, result, guards, stock_peak) -> bool:
    """`result` is below tf.gradients by the count that `guards` (`_chosen`); as
    taken, equal passes: the held count ranked it, and it is below there."""
    peak = counted_peak(model, result, guards)
    return peak < stock_peak or (guards == AS_TAKEN and peak == stock_peak)


def _as_taken(model):
    """A Result's peak with each weight gradient taken as it is made: the
    judge of `_fitting` for a model whose `weight_gradients_taken`."""
    return lambda result: counted_peak(model, result, AS_TAKEN)


def low_peak_candidates(model: GraphModel, problem=None) -> list:
    """The cut model's few best plans with the model's loops rerun, and kept in
    chunks (`loop_plans.peak_settings`), chosen at the traced sizes and as for
    batches `LARGER_BATCHES` times larger, all priced by the timeline at the
    traced sizes (`least_peak` picks one): a budget judges them by another
    peak than 'memory' does."""
    traced, larger = _traced_and_larger(model, problem or cut_problem(model))
    return traced + larger


def _traced_and_larger(model, problem) -> tuple:
    """(`_candidates` of 'memory' chosen at the traced sizes, those chosen as for
    a batch each of `LARGER_BATCHES` times larger that are not among them).
    Without weight gradients every cut-model peak scales with the batch, and
    its choices differ only by rounding: not solved again; nor at a factor of
    1, whose choices are the traced ones.

    Found once per model and `LARGER_BATCHES` (`problem` is `cut_problem(model)`):
    `MemoryWithin` runs `memory` and then takes these again, and a budget may
    follow `memory` on one model; solving them is most of `memory`'s time
    (1.0 of 1.5 s of CPU on ResNet50 at 64 px). Copies of the lists."""
    traced, larger = op_table.per_model(model, f"traced_and_larger x{LARGER_BATCHES}",
                                        lambda m: _solved_traced_and_larger(m, problem))
    return list(traced), list(larger)


def _solved_traced_and_larger(model, problem) -> tuple:
    settings = loop_plans.peak_settings(model)
    traced = _candidates(model, "memory", None, problem, settings)
    scales = [scale for scale in LARGER_BATCHES if scale != 1]
    if not scales or not problem.op_weights.any():
        return traced, []
    larger = {}
    for scale in scales:
        for r in _candidates(model, "memory", None, problem, settings, scale):
            larger.setdefault((r.plan.kept, r.plan.loops), r)
    for r in traced:  # sets differing only in tensors kept anyway make one plan
        larger.pop((r.plan.kept, r.plan.loops), None)
    return traced, list(larger.values())


def _candidates(model, name, forbidden, problem, settings, scale=1):
    """The cut model's `CANDIDATE_PLANS` best plans (`solvers.low_peak_plans`)
    under each of the loop `settings`, priced; chosen with every activation
    `scale` times its bytes (`cuts.with_activations_scaled`)."""
    problem = problem or cut_problem(model)
    per_setting = f" under each of {len(settings)} loop settings" if len(settings) > 1 else ""
    batch = f" with the activations {scale}x as large" if scale > 1 else ""
    priced = []
    for modes in settings:
        adjusted = cuts.with_activations_scaled(loop_plans.adjusted(problem, model, modes), scale)
        for found in solvers.low_peak_plans(adjusted, forbidden, CANDIDATE_PLANS):
            names = tensors_of(model, found.cost.kept_ops)
            note = (f"kept {len(names)} tensors alive across {len(found.cuts)} of "
                    f"{len(problem.cuts)} candidate cuts: the least predicted peak of the "
                    f"cut model's {CANDIDATE_PLANS} best plans{per_setting}{batch} (cut model: "
                    f"{found.cost.peak_bytes / 2**20:.1f} MiB)")
            priced.append(result_of(model, names, name, (note,), loops=modes))
    return priced


def stock(model: GraphModel, strategy, notes=()) -> Result:
    """tf.gradients itself (`planning.stock_plan`): no recompute, its own peak."""
    plan = planning.stock_plan(strategy, notes)
    return Result(strategy=strategy, chosen=(), feasible=True, notes=tuple(notes),
                  plan=plan, estimate=pricing.predict(model, plan))


def tensors_of(model: GraphModel, ops):
    """Activation tensor names of `ops`, ys left out (backprop starts from them)."""
    ys = set(model.ys)
    return {t for op in ops for t in model.op_outputs[op] if t not in ys}


STRATEGIES = {"memory": memory, "speed": speed}
# Every `checkpoints` mode name; 'collection' keeps the names the caller read
# from the graph's collection, a list (mode 'list') the names given.
MODES = ("collection", "memory", "speed")


def validate(checkpoints) -> str:
    """The mode of a `checkpoints` argument: a mode name, 'custom' for a
    callable (budgets included), 'list' for a sequence.

    The one place an unknown mode is refused, for every way in.
    """
    if isinstance(checkpoints, str):
        if checkpoints not in MODES:
            raise ValueError(f"unknown checkpoints mode {checkpoints!r}: use one of "
                             f"{', '.join(map(repr, MODES))}, a list of tensors, "
                             f"budget(max_bytes), memory_within(slack) or a callable strategy")
        return checkpoints
    return "custom" if callable(checkpoints) else "list"


@collector.paused
def select(model: GraphModel, mode: str, names=(), strategy=None) -> Result:
    """Runs the strategy of `mode` and logs what it chose.

    'collection' and 'list' keep exactly `names`; 'custom' runs `strategy`.
    """
    if mode in STRATEGIES:
        result = for_any_batch(model, STRATEGIES[mode])
    elif mode == "custom":
        result = _custom(model, strategy)
    else:
        result = explicit(model, names, mode)
    if model.unsized:
        result = dataclasses.replace(result, notes=result.notes + (unsized_note(model),))
    logger.info("memory_saving_gradients: strategy %s %s; %s", result.strategy,
                "leaves the gradient to tf.gradients" if result.plan.stock
                else f"keeps {len(result.chosen)} tensors", "; ".join(result.notes) or "-")
    return result


def for_any_batch(model: GraphModel, strategy) -> Result:
    """`strategy(model)`; for a model whose activations' sizes leave a
    dimension unknown (`unsized`), chosen as for a batch
    `UNKNOWN_DIM_CHOICE_SCALE` times the assumed one, priced at the assumed one.

    At the assumed 32 a model's weights and their gradients can outweigh its
    activations, and then every plan peaks alike and the least recompute,
    tf.gradients itself, is chosen: 12 dense layers of 512 units (hard swish)
    under 'memory' held stock's 49 MiB at a run-time batch of 512, and 16 MiB
    with that batch known (17 chosen so). Where activations are small, a plan
    chosen for a large batch costs recompute only.
    """
    if not model.unsized:
        return strategy(model)
    large = strategy(model.scaled(UNKNOWN_DIM_CHOICE_SCALE))
    if large.plan.stock:
        plan, estimate = large.plan, pricing.predict(model, large.plan)
    else:
        plan, estimate = _priced(model, frozenset(large.chosen), large.plan.loops)
    notes = (f"chosen with the activations of unknown size weighing "
             f"{UNKNOWN_DIM_CHOICE_SCALE}x (a batch of "
             f"{UNKNOWN_DIM_CHOICE_SCALE * model.unknown_dim_size}), as are the sizes in the "
             f"notes that follow; the prediction is at {model.unknown_dim_size}",) + large.notes
    plan = dataclasses.replace(plan, strategy=large.strategy, notes=notes)
    return dataclasses.replace(large, plan=plan, estimate=estimate, notes=notes)


def unsized_note(model: GraphModel) -> str:
    """Says which sizes a plan assumed, for a model with `unsized` activations
    (whatever chose it: `for_any_batch`'s own note says when that was 16x)."""
    return (f"{unsized_activations(model)}; each unknown dimension of the step's inputs "
            f"(and of function calls' and loops' outputs) is counted as "
            f"{model.unknown_dim_size}, "
            f"TensorFlow's shape functions sizing the rest, so predicted bytes are for that "
            f"size" + ("" if model.unknown_dim_size != UNKNOWN_DIM_SIZE  # a budget's batch_size
                       else f". For a plan sized to your batch, {STATIC_BATCH}"))


def unsized_activations(model: GraphModel) -> str:
    """How many activations of `model` have a dimension unknown when traced, and one of them."""
    name, shape = next(iter(model.unsized.items()))
    return (f"{len(model.unsized)} activations have dimensions unknown when traced "
            f"(e.g. {name!r}: {shape})")


# How to give a step a static batch, for messages about `GraphModel.unsized`.
STATIC_BATCH = ("trace the step with a static batch (dataset.batch(n, drop_remainder=True), "
                "or a tf.function input_signature with it)")


def run(model: GraphModel, checkpoints) -> Result:
    """`select` for a `checkpoints` value that needs no graph: a mode name
    other than 'collection', a callable, or a sequence of activation names."""
    mode = validate(checkpoints)
    return select(model, mode, () if mode == "custom" else checkpoints, checkpoints)


def _custom(model: GraphModel, strategy) -> Result:
    """Runs a user's strategy and checks that it names activations of `model`."""
    name = getattr(strategy, "__name__", None) or repr(strategy)
    picked = strategy(model)
    if isinstance(picked, Result):
        return picked
    if isinstance(picked, (str, bytes)) or not isinstance(picked, collections.abc.Iterable):
        raise TypeError(f"custom checkpoints strategy {name} returned "
                        f"{type(picked).__name__}; it must return a list of tensor "
                        f"names (strings such as 'dense/Relu:0')")
    picked = list(picked)
    for item in picked:
        if not isinstance(item, str):
            hint = " (use its .name)" if isinstance(getattr(item, "name", None), str) else ""
            raise TypeError(f"custom checkpoints strategy {name} returned {item!r}; "
                            f"return tensor names (strings){hint}")
    unknown = [n for n in picked if n not in model.graph]
    if unknown:
        sample = ", ".join(model.order[:3])
        raise ValueError(f"custom checkpoints strategy {name} returned names that are "
                         f"not activations between xs and ys: {unknown[:5]}; pick names "
                         f"from model.order (for example {sample})")
    return result_of(model, set(picked), f"custom:{name}")
