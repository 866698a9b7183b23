"""The one place a plan is priced.

Every strategy, the budget search and `checkpoint_plan` call `predict`, so
the simulator behind it (the timeline model) can change here only.
"""

from memory_saving_gradients.core import timeline


def predict(model, plan) -> timeline.Estimate:
    """Predicted activation peak and recompute cost of `plan` on `model`."""
    return timeline.predict(model, plan)
