"""`memory_within(slack)`: the least recompute within a slack above the least
predicted peak ('memory'). Core models, and one Keras encoder traced in a
tf.function whose gradients are compared with tf.gradients'."""

import pytest

import memory_saving_gradients as msg
from memory_saving_gradients.core import strategies
from random_models import random_model
from test_selection import chain_model
from test_selection import residual_model

MODELS = {**{f"random{seed}": (lambda seed=seed: random_model(seed, ops=60 + 20 * seed))
             for seed in range(2, 6)},
          "residual40": lambda: residual_model(40)[0], "chain64": lambda: chain_model(64)[0]}


@pytest.mark.parametrize("slack", [0.0, 0.05, 0.1, 0.3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_within_its_slack_of_memory_and_recomputing_no_more(name, slack):
    model = MODELS[name]()
    least, found = strategies.memory(model), msg.memory_within(slack)(model)
    assert found.peak_bytes <= least.peak_bytes * (1 + slack)
    assert found.peak_bytes < found.estimate.baseline_bytes
    assert found.recompute_flops <= least.recompute_flops
    assert found.strategy == f"memory_within({slack:g})"


def test_a_slack_buys_back_recompute():
    """On this random model (scratch, weight gradients, pinned ops) a plan 10%
    above the least predicted peak recomputes 18% less than 'memory' (8% above
    for 16% less before session 71 lowered 'memory''s peak: within 10% of it,
    9% less now)."""
    model = random_model(4, ops=120)
    least, found = strategies.memory(model), msg.memory_within(0.15)(model)
    assert found.recompute_flops < 0.85 * least.recompute_flops
    assert least.peak_bytes < found.peak_bytes <= 1.15 * least.peak_bytes
    assert any("least recompute found within 15% of the least predicted peak" in n
               for n in found.notes)


def test_says_so_when_nothing_within_the_slack_recomputes_less():
    """On the 40-block residual net the next plan is 6% above 'memory''s peak."""
    model, _ = residual_model(40)
    least, found = strategies.memory(model), msg.memory_within(0.02)(model)
    assert found.chosen == least.chosen
    assert "no plan found within 2% of the least predicted peak recomputes less" in found.notes[-1]


def test_a_larger_slack_finds_what_a_smaller_one_does():
    """One search under 10% gives up on this model (the timeline keeps
    overshooting the cut model) where one under 5% finds 0.81 of 'memory''s
    recompute; the search under halves of the slack finds it at 10% too."""
    model = random_model(5, ops=160)
    least = strategies.memory(model)
    found = {s: msg.memory_within(s)(model) for s in (0.05, 0.1)}
    assert found[0.05].recompute_flops < 0.85 * least.recompute_flops
    assert found[0.1].recompute_flops <= found[0.05].recompute_flops
    assert strategies.fitting_plan(model, strategies.cut_problem(model),
                                   int(1.1 * least.peak_bytes), "one search") is None


def test_slacks_are_kept_as_floats_and_named_as_given():
    from fractions import Fraction
    within = msg.memory_within(Fraction(1, 10))
    assert within.slack == 0.1 and within.__name__ == "memory_within(0.1)"
    assert msg.memory_within(0.004).__name__ == "memory_within(0.004)"


def test_a_huge_slack_is_capped_below_tf_gradients_peak():
    model = random_model(4, ops=120)
    found = msg.memory_within(1e300)(model)
    assert found.peak_bytes < found.estimate.baseline_bytes


@pytest.mark.parametrize("value, error, words", [
    (-0.1, ValueError, "finite share of at least 0"),
    (float("inf"), ValueError, "finite share"),
    (float("nan"), ValueError, "finite share"),
    ("10%", TypeError, "takes a share of the least predicted peak .0.1 for 10%"),
    (True, TypeError, "got bool"),
    (None, TypeError, "got NoneType"),
])
def test_bad_slacks_fail_at_construction(value, error, words):
    with pytest.raises(error, match=words):
        msg.memory_within(value)


def test_on_a_transformer_it_recomputes_less_and_its_gradients_are_stock():
    """A four-block Keras encoder: 'memory' recomputes 0.65 of a forward pass,
    memory_within(0.1) about 0.55 at 8% more predicted peak; the gradients of
    both equal tf.gradients'."""
    import numpy as np
    import tensorflow as tf
    from benchmarks.predicted_vs_measured import SMALL_MODELS, loss_and_weights
    build, data = SMALL_MODELS["transformer"]
    model = build()
    inputs, labels = (tf.constant(a) for a in data())
    slack = msg.memory_within(0.1)
    plans = {}

    @tf.function
    def step(inputs, labels):
        loss, weights = loss_and_weights(model, inputs, labels)
        for name, checkpoints in (("memory", "memory"), ("within", slack)):
            plans[name] = msg.checkpoint_plan(loss, weights, checkpoints).estimate
        return (tf.gradients(loss, weights), msg.gradients(loss, weights, checkpoints="memory"),
                msg.gradients(loss, weights, checkpoints=slack))

    stock, memory, within = step(inputs, labels)
    assert plans["within"].recompute_flops < 0.95 * plans["memory"].recompute_flops
    assert plans["within"].peak_bytes <= 1.1 * plans["memory"].peak_bytes
    for ours in (memory, within):
        for a, b in zip(stock, ours):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-5)
