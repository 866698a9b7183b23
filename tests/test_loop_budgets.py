"""Budgets buy time back on recurrent stacks: a plan may keep a loop instead of rerunning it.

A Keras RNN's While loop is pinned (its outputs feed list ops that cannot be
rerun) and was rebuilt by its level, in chunks, whatever the plan: every
budget above the `'memory'` plan's peak returned that plan (the benchmarks'
LSTM stack, 50% and 70%). Now a plan may differentiate the loop where it is
(`planning.LoopModes`), in chunks or by the stock gradient.

Ours and stock are built in two tf.functions: stock tf.gradients built first
in the same graph would give the loops while_v2's accumulators (harness.py),
and another model.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph.compat import stock_gradients

STEPS, FEATURES, UNITS, BATCH = 12, 8, 16, 32


def _lstm_stack():
    """forward(x) -> (loss, weights): a Dense stem and two residual LSTM layers."""
    import keras
    keras.utils.set_random_seed(0)
    stem = keras.layers.Dense(UNITS)
    lstms = [keras.layers.LSTM(UNITS, return_sequences=True) for _ in range(2)]

    def forward(x):
        h = stem(x)
        for lstm in lstms:
            h = h + lstm(h)
        weights = [w.value for layer in [stem] + lstms for w in layer.trainable_weights]
        return tf.reduce_sum(tf.square(h[:, -1])), weights
    return forward


@pytest.fixture(scope="module", params=[0.5, 1.0])
def budgeted(request):
    """A budget `share` of the way from the 'memory' plan's peak to tf.gradients'
    (as the allocator counts them):
    (share, plans found while tracing ours, our gradients, stock's)."""
    share, forward, found = request.param, _lstm_stack(), {}
    x = tf.constant(np.random.default_rng(0).normal(size=(BATCH, STEPS, FEATURES)),
                    tf.float32)
    forward(x)  # the layers make their variables outside the tf.functions

    @tf.function
    def ours(x):
        loss, weights = forward(x)
        memory = msg.checkpoint_plan(loss, weights, "memory")
        # As a BFC allocator counts them: what budgets are judged by.
        least = memory.estimate.allocator_peak_bytes
        stock = memory.estimate.allocator_baseline_bytes
        found.update(memory=memory, limit=least + share * (stock - least))
        found["plan"] = msg.checkpoint_plan(loss, weights, msg.budget(found["limit"]))
        return msg.gradients(loss, weights, checkpoints=msg.budget(found["limit"]))

    @tf.function
    def stock(x):
        loss, weights = forward(x)
        return stock_gradients(loss, weights)

    return share, found, ours(x), stock(x)


def test_a_budget_above_the_least_peak_recomputes_less_than_memory(budgeted):
    """Before: both budgets returned the 'memory' plan (same peak, same recompute:
    each loop rerun by its level, twice). At tf.gradients' memory nothing is
    rerun: tf.gradients itself, both loops with the stock gradient's stacks."""
    share, found, _, _ = budgeted
    plan, memory = found["plan"], found["memory"]
    assert plan.estimate.allocator_peak_bytes <= found["limit"]
    assert plan.estimate.recompute_flops < memory.estimate.recompute_flops
    if share == 1.0:
        assert plan.plan.stock and plan.estimate.recompute_flops == 0
    else:
        assert any("loop" in note and "kept" in note for note in plan.notes)


def test_budgeted_gradients_match_tf_gradients(budgeted):
    _, _, ours, stock = budgeted
    assert len(ours) == len(stock)
    for mine, theirs in zip(ours, stock):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)
