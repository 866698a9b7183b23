"""The one place a plan is priced.

Every strategy, the budget search and `checkpoint_plan` call `predict`, so
switching to another simulator (the timeline model) is a change here only.
"""

from memory_saving_gradients.core import simulation


def predict(model, plan) -> simulation.Estimate:
    """Predicted activation peak and recompute cost of `plan` on `model`."""
    return simulation.estimate(model, plan)
