"""Budgets: the plan of least recompute whose predicted peak fits a byte budget.

No TensorFlow. `Budget` is a strategy (a callable on the GraphModel), so it is
accepted wherever ``checkpoints=`` is.
"""

import dataclasses
import math
import numbers

from memory_saving_gradients.core import strategies


def describe_bytes(count) -> str:
    return f"{count / 2**20:.2f} MiB ({int(count)} bytes)"


@dataclasses.dataclass(frozen=True)
class Budget:
    """``checkpoints=budget(max_bytes)``: least recompute with a predicted peak <= max_bytes.

    The peak is of activation memory (what checkpointing changes; weights and
    their gradients come on top), as `checkpoint_plan(...).estimate` predicts it.
    """
    max_bytes: float

    def __post_init__(self):
        value = self.max_bytes
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"budget(max_bytes) takes a number of bytes, got "
                            f"{type(value).__name__}: {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"budget(max_bytes) must be a positive, finite number of "
                             f"bytes, got {value!r}")

    @property
    def __name__(self):
        return f"budget({self.max_bytes / 2**20:.2f} MiB)"

    def __call__(self, model) -> strategies.Result:
        """The plan; ValueError naming the smallest feasible budget if none fits."""
        stock = strategies.stock(model, self.__name__)
        if stock.peak_bytes <= self.max_bytes:  # no recompute at all fits
            return dataclasses.replace(stock, notes=(
                f"tf.gradients' predicted peak of {describe_bytes(stock.peak_bytes)} fits "
                f"within {describe_bytes(self.max_bytes)}: the stock gradient, every "
                f"activation kept, nothing recomputed",))
        problem = strategies.cut_problem(model)
        least = strategies.least_peak(model, problem)
        if least.peak_bytes > self.max_bytes:
            # The cut model's least-peak candidates are not always the timeline's
            # least: the 'speed' plan (at worst no cut at all) may be priced lower.
            least = min(least, strategies.speed(model), key=lambda r: r.peak_bytes)
        if least.peak_bytes > self.max_bytes:
            raise ValueError(
                f"no checkpoint plan fits a budget of {describe_bytes(self.max_bytes)}: "
                f"the smallest feasible budget "
                f"on this graph is {describe_bytes(least.peak_bytes)} (the "
                f"'{least.strategy}' plan; tf.gradients needs "
                f"{describe_bytes(least.estimate.baseline_bytes)}). "
                f"Raise the budget to at least that, or shrink the batch")
        found = strategies.fitting_plan(model, problem, self.max_bytes, self.__name__)
        fitting = [least] + ([found] if found is not None else [])
        best = min(fitting, key=lambda r: (r.recompute_flops, r.peak_bytes))
        note = (f"least predicted recompute with a predicted peak of "
                f"{describe_bytes(best.peak_bytes)} within {describe_bytes(self.max_bytes)}")
        return dataclasses.replace(best, strategy=self.__name__, notes=best.notes + (note,))


def budget(max_bytes) -> Budget:
    """A checkpoints strategy: least recompute whose predicted activation peak fits.

    Example:
      >>> grads = memory_saving_gradients.gradients(
      ...     loss, params, checkpoints=memory_saving_gradients.budget(200 * 2**20))
    """
    return Budget(max_bytes)
