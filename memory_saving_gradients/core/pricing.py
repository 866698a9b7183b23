"""The one place a plan is priced.

Every strategy, the budget search and `checkpoint_plan` call `predict`, so
the simulator behind it (the timeline model) can change here only. Budgets
also judge plans by `with_allocator_peaks`: the same step replayed through a
simulated BFC allocator (`core/allocator.py`).
"""

from memory_saving_gradients.core import op_table
from memory_saving_gradients.core import timeline

MAX_REPLAYED = 32  # allocator replays remembered per model (a budget runs a few)
MAX_TAKEN = 64  # activation peaks remembered per model ('memory' ranks ~20 plans by it)


def predict(model, plan) -> timeline.Estimate:
    """Predicted activation peak and recompute cost of `plan` on `model`."""
    return timeline.predict(model, plan)


def activation_peak(model, plan) -> int:
    """`plan`'s peak with each weight gradient taken as it is made (an optimizer
    step in the same graph), not held to the end as `predict` holds it; once
    per model and plan: `strategies` ranks and judges each candidate by it
    more than once, and each is a replay of the model."""
    if plan is None or plan.stock:  # remembered per model by the timeline
        return timeline.activation_peak(model, plan)
    return _remembered(model, "activation_peaks", MAX_TAKEN, plan,
                       lambda: timeline.activation_peak(model, plan))


def with_allocator_peaks(model, plan, estimate) -> timeline.Estimate:
    """`estimate` (`predict`'s of `plan`) with the peak a BFC allocator reaches
    (`allocator_peak_bytes`: whole chunks, never below the bytes requested),
    once per model and plan: the replay costs about four predictions (0.29 s
    against 0.08 s on a 10,000-op model), so searches replay only the plans
    that already fit by bytes requested."""
    return _remembered(model, "allocator_replays", MAX_REPLAYED, plan,
                       lambda: timeline.with_allocator_peaks(model, plan, estimate))


def _remembered(model, table, most, plan, replay):
    """`replay()`, remembered in the model's `table` (at most `most` plans) under
    what a plan's levels are made of (`strategies._priced`)."""
    seen = op_table.per_model(model, table, lambda _: {})
    key = (plan.stock, plan.kept, plan.loops)
    if key not in seen:
        if len(seen) >= most:
            seen.clear()
        seen[key] = replay()
    return seen[key]


def allocator_baseline_bytes(model) -> int:
    """Stock tf.gradients' activation peak as a BFC allocator counts it (once per model)."""
    return timeline.with_allocator_peaks(model, None, predict(model, None)).allocator_baseline_bytes
