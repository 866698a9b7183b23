"""The planner's choices and predictions on fixed models, against a recorded copy.

Speed work on the planner (tabling per-model facts, replaying the forward
pass once, pricing each plan once) must not change what it chooses: on
random models (`random_models.py`: multi-output, aliasing and pinned ops,
scratch, weight gradients, loops) and on a chain and a residual network,
every strategy's kept tensors, levels and estimate must equal those recorded
in `data/plans_golden.json`, written by the planner before that work.

When the memory model changes on purpose (the timeline prices differently),
rewrite the record and say why in the commit:
    PYTHONPATH=$PWD python3 tests/test_plans_unchanged.py --write
No TensorFlow graphs.
"""

import json
import pathlib
import sys

import pytest

from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import pricing
from memory_saving_gradients.core import strategies
from random_models import random_model
from test_selection import chain_model
from test_selection import residual_model

GOLDEN = pathlib.Path(__file__).parent / "data" / "plans_golden.json"
MODELS = {
    **{f"random{seed}": (lambda seed=seed: random_model(seed, ops=40 + 20 * seed))
       for seed in range(6)},
    "chain100": lambda: chain_model(100)[0],
    "residual60": lambda: residual_model(60)[0],
}


def strategies_of(model):
    """'memory', 'speed', and budgets a third and two thirds of the way from
    the least peak to tf.gradients' (feasible on every model), both as a BFC
    allocator counts them (what budgets are judged by)."""
    least = budgets.least_feasible(model).estimate.allocator_peak_bytes
    stock = pricing.allocator_baseline_bytes(model)
    return {"memory": "memory", "speed": "speed",
            **{f"budget{k}/3": budgets.budget(least + (stock - least) * k / 3 + 1)
               for k in (1, 2)}}


def describe(result):
    est = result.estimate
    return {"chosen": list(result.chosen), "kept": list(result.plan.kept),
            "levels": [[list(level.checkpoints), list(level.copy_ops)]
                       for level in result.plan.levels],
            "estimate": [est.peak_bytes, est.kept_bytes, est.largest_segment_bytes,
                         est.baseline_bytes, est.recompute_flops, est.forward_flops]}


def plans_of(name):
    model = MODELS[name]()
    return {label: describe(strategies.run(model, strategy))
            for label, strategy in strategies_of(model).items()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plans_and_predictions_are_as_recorded(name):
    recorded = json.loads(GOLDEN.read_text())[name]
    assert plans_of(name) == recorded


def test_each_set_of_kept_tensors_is_priced_once_per_model(monkeypatch):
    model = random_model(3, ops=100)
    priced, predict = [], pricing.predict
    monkeypatch.setattr(pricing, "predict", lambda m, plan: priced.append(plan.kept)
                        or predict(m, plan))
    strategies.memory(model)
    strategies.memory(model)
    assert priced and len(priced) == len(set(priced))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({name: plans_of(name) for name in sorted(MODELS)}))
