"""`budget(max_bytes, batch_size=n)` on a step traced with its batch unknown
(Keras `fit` on arrays): planned as with the batch known, same gradients as
stock at any batch up to it, and the measured peak within the budget (bytes
requested: the allocation records hold BFC's chunks, which depend on what the
process allocated before; one CI run recorded 1.15x the budget)."""

import re

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from harness import requested_session_peak
from test_keras import fit_vs_stock

WIDTH, BATCH, DEPTH = 256, 1024, 30  # 1 MiB activations; scale vectors for weights


def _chain(batch):
    """A chain of tanh(h * w) with per-feature scales w (weight gradients of
    1 KiB: the step's peak is its activations). (x, ws, loss)."""
    x = tf.compat.v1.placeholder(tf.float32, [batch, WIDTH])
    ws = [tf.compat.v1.placeholder(tf.float32, [WIDTH]) for _ in range(DEPTH)]
    h = x
    for w in ws:
        h = tf.tanh(h * w) + h
    return x, ws, tf.reduce_sum(h * h)


def _halfway_budget():
    """Halfway between the least feasible peak and tf.gradients', with the batch known."""
    with tf.Graph().as_default():
        _, ws, loss = _chain(BATCH)
        least = msg.checkpoint_plan(loss, ws, "memory").estimate
    return (least.allocator_peak_bytes + least.allocator_baseline_bytes) / 2


def _feed(x, ws, rows):
    rng = np.random.RandomState(rows)
    return {x: rng.randn(rows, WIDTH).astype(np.float32),
            **{w: (0.5 + 0.1 * rng.rand(WIDTH)).astype(np.float32) for w in ws}}


def test_a_budget_given_the_batch_plans_as_with_the_batch_known():
    budget = _halfway_budget()
    plans = []
    for batch, strategy in ((BATCH, msg.budget(budget)),
                            (None, msg.budget(budget, batch_size=BATCH))):
        with tf.Graph().as_default():
            _, ws, loss = _chain(batch)
            plans.append(msg.checkpoint_plan(loss, ws, strategy))
    known, given = plans
    assert given.model.unknown_dim_size == BATCH and given.model.unsized
    assert [t.name for t in given.checkpoints] == [t.name for t in known.checkpoints]
    assert known.checkpoints  # the budget is below tf.gradients': something is recomputed
    assert given.estimate == known.estimate
    assert any(f"counted as {BATCH}" in note for note in given.notes), given.notes


def test_gradients_match_stock_at_any_batch_and_the_budget_is_met():
    budget = _halfway_budget()
    with tf.Graph().as_default():
        x, ws, loss = _chain(None)
        ours = msg.gradients(loss, ws, checkpoints=msg.budget(budget, batch_size=BATCH))
        stock = tf.gradients(loss, ws)
        with tf.compat.v1.Session() as sess:
            for rows in (BATCH, 100):  # the largest batch, and a last partial one
                ours_peak, ours_values = requested_session_peak(sess, ours, _feed(x, ws, rows))
                stock_values = sess.run(stock, _feed(x, ws, rows))
                for o, s in zip(ours_values, stock_values):
                    np.testing.assert_allclose(o, s, rtol=1e-4, atol=1e-4)
                if rows == BATCH:
                    assert ours_peak <= 1.15 * budget, ours_peak / budget


def test_fit_on_arrays_takes_a_budget_given_the_batch(caplog):
    def build():
        return tf.keras.Sequential([tf.keras.Input((16,))]
                                   + [tf.keras.layers.Dense(128, activation="tanh")
                                      for _ in range(6)] + [tf.keras.layers.Dense(4)])

    rng = np.random.RandomState(3)
    x, y = rng.randn(600, 16).astype("float32"), rng.randint(0, 4, 600)
    fit = {"batch_size": 256}  # batches of 256, 256 and 88
    with pytest.raises(ValueError, match="smallest feasible budget") as refused:
        fit_vs_stock(build, x, y, caplog, fit_kwargs=fit,
                     checkpoints=msg.budget(1, batch_size=256))
    least = int(re.search(r"smallest feasible budget on this graph is [\d.]+ MiB \((\d+) ",
                          str(refused.value)).group(1))
    fit_vs_stock(build, x, y, caplog, fit_kwargs=fit,
                 checkpoints=msg.budget(least, batch_size=256))
    assert "counted as 256" in caplog.text and "least predicted recompute" in caplog.text


def test_a_budget_refuses_a_step_leaving_another_dimension_unknown():
    with tf.Graph().as_default():
        tokens = tf.compat.v1.placeholder(tf.float32, [None, None, WIDTH])  # batch, length
        w = tf.compat.v1.placeholder(tf.float32, [WIDTH])
        loss = tf.reduce_sum(tf.tanh(tf.tanh(tokens * w) * w))
        with pytest.raises(ValueError,
                           match=r"another dimension unknown too .*'mul:0': \(None, None, 256\)"):
            msg.checkpoint_plan(loss, [w], msg.budget(2**30, batch_size=16))


def _loop_step(batch):
    x = tf.compat.v1.placeholder(tf.float32, [batch, WIDTH])
    w = tf.compat.v1.placeholder(tf.float32, [WIDTH, WIDTH])
    _, h = tf.while_loop(lambda i, h: i < 8, lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                         (0, x), maximum_iterations=8)
    return [w], tf.reduce_sum(h * h)


def test_a_loop_read_at_the_default_size_is_read_again_at_the_batch_given():
    """A loop's bytes per iteration, measured once per loop, are measured again
    for another size: planned at 32 first, a budget's were 32 rows' (its
    step measured 1.34x the budget)."""
    given = msg.budget(2**40, batch_size=BATCH)
    loops = []
    for plan_first in (True, False):
        with tf.Graph().as_default():
            ws, loss = _loop_step(None)
            if plan_first:
                msg.checkpoint_plan(loss, ws, "memory")
            model = msg.checkpoint_plan(loss, ws, given).model
            loops.append({name: loop.iteration_bytes for name, loop in model.loops.items()})
    assert loops[0] == loops[1] and loops[0], loops
    assert next(iter(loops[0].values())) >= BATCH * WIDTH * 4  # a row of the batch per h


def test_without_the_batch_a_budget_says_how_to_give_it():
    with tf.Graph().as_default():
        _, ws, loss = _chain(None)
        with pytest.raises(ValueError, match=r"budget\(max_bytes, batch_size=n\)"):
            msg.checkpoint_plan(loss, ws, msg.budget(2**30))


def test_a_budget_called_on_a_model_read_at_another_size_refuses():
    def inner(model):
        return msg.budget(2**30, batch_size=BATCH)(model)

    with tf.Graph().as_default():
        _, ws, loss = _chain(None)
        with pytest.raises(ValueError, match=r"read with its unknown dimensions as 32"):
            msg.checkpoint_plan(loss, ws, inner)


@pytest.mark.parametrize("size", [0, -4, 2.5, True, "64"])
def test_a_batch_size_that_is_not_a_positive_whole_number_is_refused(size):
    with pytest.raises(ValueError, match=r"batch_size=\.\.\.\) must be a positive whole number"):
        msg.budget(2**30, batch_size=size)
