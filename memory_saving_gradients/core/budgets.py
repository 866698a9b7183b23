"""Budgets: the plan of least recompute whose predicted peak fits a byte budget
(the peak a BFC allocator reaches: `Budget`), or a slack above the least
predicted peak (`MemoryWithin`).

No TensorFlow. Both are strategies (callables on the GraphModel), so they are
accepted wherever ``checkpoints=`` is.
"""

import dataclasses
import math
import numbers
from typing import Optional

from memory_saving_gradients.core import op_table
from memory_saving_gradients.core import strategies


SLACK_STEPS = 4  # memory_within's searches: under its slack, a half, a quarter, an eighth


def describe_bytes(count) -> str:
    return f"{count / 2**20:.2f} MiB ({int(count)} bytes)"


def _real(value, call, expects):
    """`value`, a real number (not a bool); else a TypeError naming `call`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{call} takes {expects}, got {type(value).__name__}: {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Budget:
    """``checkpoints=budget(max_bytes)``: least recompute with a predicted peak <= max_bytes.

    The peak is of activation memory (what checkpointing changes; weights and
    their gradients come on top) as a BFC allocator counts it: the whole
    chunks it hands out, replayed by `core/allocator.py`. That is what
    TensorFlow measures on GPUs and on CPU with TF_CPU_ALLOCATOR_USE_BFC=1
    (`checkpoint_plan(...).estimate.allocator_peak_bytes`); it is never below
    the bytes the ops request (`estimate.peak_bytes`), the peak of CPU's
    default allocator, so a plan within the budget fits that one too.

    `batch_size`: for a step traced with its batch unknown (Keras `fit` on
    arrays whose length is not a multiple of its batch size, or on a dataset
    batched without drop_remainder), the largest batch it runs (per replica,
    under a distribution strategy): each dimension unknown when traced counts
    as that many when the graph is read (`sized_shapes.unknown_dims_as`), so
    the budget holds for batches up to it. Without it such a step is refused,
    and so is one leaving another dimension unknown too (a sequence length:
    `api._check_batch_alone_unknown`).
    """
    max_bytes: float
    batch_size: Optional[int] = None

    def __post_init__(self):
        value = _real(self.max_bytes, "budget(max_bytes)", "a number of bytes")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"budget(max_bytes) must be a positive, finite number of "
                             f"bytes, got {value!r}")
        size = self.batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, numbers.Integral)
                                 or size <= 0):
            raise ValueError(f"budget(batch_size=...) must be a positive whole number of "
                             f"examples (the largest batch the step runs), got {size!r}")

    @property
    def __name__(self):
        batch = "" if self.batch_size is None else f", batch_size={self.batch_size}"
        return f"budget({self.max_bytes / 2**20:.2f} MiB{batch})"

    def __call__(self, model) -> strategies.Result:
        """The plan; ValueError naming the smallest feasible budget if none fits.

        Plans are priced by bytes requested (`pricing.predict`) and the ones
        that fit by those are replayed through the allocator
        (`strategies.allocator_peak`, about four predictions' cost): the
        least-recompute search re-solves tighter when the replay overshoots.
        """
        if model.unsized and self.batch_size is None:
            raise ValueError(
                f"{self.__name__} cannot be checked on this graph: "
                f"{strategies.unsized_activations(model)}, so their bytes are not known: "
                f"give the largest batch the step runs, budget(max_bytes, batch_size=n), "
                f"or {strategies.STATIC_BATCH}, or use a mode ('memory', 'speed') or "
                f"memory_within(slack)")
        if model.unsized and model.unknown_dim_size != self.batch_size:
            raise ValueError(
                f"{self.__name__} was given batch_size={self.batch_size}, but this graph "
                f"was read with its unknown dimensions as {model.unknown_dim_size}: pass "
                f"the budget as checkpoints= to memory_saving_gradients' gradients, "
                f"checkpoint_plan or an integration, which read the graph for it")

        def peak(result):
            return strategies.allocator_peak(model, result)

        def fits(result):  # bytes requested first: the replay is never below them
            return result.peak_bytes <= self.max_bytes and peak(result) <= self.max_bytes

        stock = strategies.with_allocator_peak(model, strategies.stock(model, self.__name__))
        if peak(stock) <= self.max_bytes:  # no recompute at all fits
            return dataclasses.replace(stock, notes=(
                f"tf.gradients' predicted peak of {describe_bytes(peak(stock))} as a BFC "
                f"allocator counts it fits within {describe_bytes(self.max_bytes)}: the "
                f"stock gradient, every activation kept, nothing recomputed",))
        problem = strategies.cut_problem(model)
        found = strategies.fitting_plan(model, problem, self.max_bytes, self.__name__, peak)
        # The cut model's least-peak plans (what `least_peak` picks from), which
        # the search does not see whole, can recompute less than what it found.
        candidates = strategies.low_peak_candidates(model, problem)
        fitting = [r for r in candidates
                   if (found is None or r.recompute_flops < found.recompute_flops) and fits(r)]
        fitting += [found] if found is not None else []
        if not fitting:  # the search can miss a plan that fits (`feasible_plans`)
            fitting = [r for r in feasible_plans(model, problem)
                       if r.estimate.allocator_peak_bytes <= self.max_bytes]
        if not fitting:
            least = least_feasible(model, problem)
            raise ValueError(
                f"no checkpoint plan fits a budget of {describe_bytes(self.max_bytes)} "
                f"(activation memory as a BFC allocator counts it): the smallest "
                f"feasible budget on this graph is "
                f"{describe_bytes(least.estimate.allocator_peak_bytes)} (tf.gradients needs "
                f"{describe_bytes(least.estimate.allocator_baseline_bytes)}). "
                f"Raise the budget to at least that, or shrink the batch")
        best = strategies.with_allocator_peak(
            model, min(fitting, key=lambda r: (r.recompute_flops, peak(r))))
        note = (f"least predicted recompute with a predicted peak of "
                f"{describe_bytes(peak(best))} as a BFC allocator counts it "
                f"({describe_bytes(best.peak_bytes)} requested) within "
                f"{describe_bytes(self.max_bytes)}")
        return dataclasses.replace(best, strategy=self.__name__, notes=best.notes + (note,))


def least_feasible(model, problem=None) -> strategies.Result:
    """The plan of least peak as a BFC allocator counts it among `feasible_plans`
    (ties: least recompute): its `estimate.allocator_peak_bytes` is the smallest
    budget `Budget` accepts."""
    return min(feasible_plans(model, problem),
               key=lambda r: (r.estimate.allocator_peak_bytes, r.recompute_flops))


def feasible_plans(model, problem=None) -> list:
    """The plans the budgeted search can meet below the peaks of tf.gradients,
    the 'speed' plan and the cut model's least-peak candidates
    (`strategies.low_peak_candidates`), and those, each with its allocator peak
    in its estimate (once per model).

    The search under a budget (`strategies.fitting_plan`) starts from the
    least-recompute plan under it and re-solves tighter: every plan it can
    return is on the cut model's staircase of least recompute against
    cut-model peak (`strategies.staircase`), which it walks in steps too
    coarse to see all of it (a budget's search found plans up to 12% below
    those starting peaks, and missed them at budgets just above). The whole
    staircase is priced here; only plans whose bytes requested are below the
    least allocator peak so far are replayed (the replay is never below them).
    Remembered per model and `strategies.LARGER_BATCHES`, which set the candidates.
    """
    return op_table.per_model(model, f"feasible_plans x{strategies.LARGER_BATCHES}",
                              lambda m: _feasible_plans(m, problem))


def _feasible_plans(model, problem):
    problem = problem or strategies.cut_problem(model)
    met = [strategies.with_allocator_peak(model, r) for r in
           strategies.low_peak_candidates(model, problem)
           + [strategies.speed(model), strategies.stock(model, "stock")]]
    least = min(r.estimate.allocator_peak_bytes for r in met)
    for result in strategies.staircase(model, problem, least, "least feasible"):
        if result.peak_bytes < least:
            met.append(strategies.with_allocator_peak(model, result))
            least = min(least, met[-1].estimate.allocator_peak_bytes)
    return met


@dataclasses.dataclass(frozen=True)
class MemoryWithin:
    """``checkpoints=memory_within(slack)``: least recompute with a predicted
    peak at most ``1 + slack`` times the 'memory' plan's (0.1: 10% above it).

    'memory' is the least predicted peak, and its last few percent are often
    bought with much recompute (BERT, 2 layers, 'memory': 0.67 of a forward
    pass recomputed at 25.1 MiB predicted; within 10%: 0.45 at 27.1). Peaks
    are bytes requested, as for 'memory' (`estimate.peak_bytes`), not a BFC
    allocator's chunks as for `Budget`, and below tf.gradients' own; where
    'memory' is tf.gradients itself, so is this.
    """
    slack: float

    def __post_init__(self):
        value = _real(self.slack, "memory_within(slack)",
                      "a share of the least predicted peak (0.1 for 10% above it)")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"memory_within(slack) must be a finite share of at least 0 "
                             f"(0.1 for 10% above the least predicted peak), got {value!r}")
        object.__setattr__(self, "slack", float(value))

    @property
    def __name__(self):
        return f"memory_within({self.slack:g})"

    def __call__(self, model) -> strategies.Result:
        """The plan (chosen as 'memory' is for a step of unknown batch,
        `strategies.for_any_batch`)."""
        return strategies.for_any_batch(model, self._within)

    def _within(self, model) -> strategies.Result:
        """Searched under `SLACK_STEPS` ceilings, `slack` and halves of it: one
        search stops after a few overshoots of the timeline over the cut model,
        and can miss a plan that a lower ceiling finds."""
        problem = strategies.cut_problem(model)
        least = strategies.memory(model, problem)
        if least.plan.stock:  # nothing recomputes less
            return dataclasses.replace(least, strategy=self.__name__)
        ceilings = self._ceilings(least)
        found = [strategies.fitting_plan(model, problem, ceiling, self.__name__)
                 for ceiling in ceilings]
        # As in `Budget`: the plans 'memory' picks from, which the search does not
        # see whole, can recompute less than what it found.
        found += [r for r in strategies.low_peak_candidates(model, problem)
                  if r.peak_bytes <= ceilings[-1]]
        cheaper = [r for r in found if r is not None and r.recompute_flops < least.recompute_flops]
        share = f"{100 * self.slack:.3g}%"
        if not cheaper:
            return dataclasses.replace(least, strategy=self.__name__, notes=least.notes + (
                f"no plan found within {share} of the least predicted peak recomputes "
                f"less: the 'memory' plan",))
        best = min(cheaper, key=lambda r: (r.recompute_flops, r.peak_bytes))
        return dataclasses.replace(best, strategy=self.__name__, notes=best.notes + (
            f"least recompute found within {share} of the least predicted peak "
            f"({describe_bytes(least.peak_bytes)}, {least.recompute_flops:.3g} FLOPs "
            f"recomputed there)",))

    def _ceilings(self, least):
        """Peaks searched under: `slack`, `slack` / 2, ... above `least`'s, each
        below tf.gradients' own peak (and not below `least`'s)."""
        top = least.estimate.baseline_bytes - 1
        shares = [self.slack / 2**k for k in range(SLACK_STEPS)]
        return sorted({max(least.peak_bytes, int(min(least.peak_bytes * (1 + s), top)))
                       for s in shares})


def memory_within(slack) -> MemoryWithin:
    """A checkpoints strategy: least recompute within `slack` of the least
    predicted peak ('memory' trading a little memory for step time).

    Example:
      >>> grads = memory_saving_gradients.gradients(
      ...     loss, params, checkpoints=memory_saving_gradients.memory_within(0.1))
    """
    return MemoryWithin(slack)


def budget(max_bytes, batch_size=None) -> Budget:
    """A checkpoints strategy: least recompute whose predicted activation peak
    (as a BFC allocator counts it) fits; `batch_size`, the largest batch of a
    step traced with its batch unknown (`Budget`).

    Example:
      >>> grads = memory_saving_gradients.gradients(
      ...     loss, params, checkpoints=memory_saving_gradients.budget(200 * 2**20))
      >>> model.fit(x, y, batch_size=64, callbacks=[memory_saving_gradients.keras.Checkpointing(
      ...     memory_saving_gradients.budget(200 * 2**20, batch_size=64))])
    """
    return Budget(max_bytes, batch_size)
