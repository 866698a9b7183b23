"""Adversarial cases for the s20 merge (capture index, one-op gates, new
control edges): gradients must equal stock tf.gradients."""

import numpy as np
import pytest
import tensorflow as tf

from harness import Model, assert_matches_stock, gradients_vs_stock

RANK9 = [2] * 9


def _rank9_chain(ctx, x):
    """A weight of rank 9 (the gates read its gradient), checkpointed chain."""
    w = ctx.variable("w", np.linspace(0.5, 1.5, 512).reshape(RANK9).astype(np.float32))
    hs = [x]
    for _ in range(6):
        hs.append(tf.tanh(hs[-1] * w))
    return Model(ys=[tf.reduce_sum(hs[-1] ** 2)], xs=[w, x], lists={"mid": [hs[2], hs[4]]})


@pytest.fixture
def no_grappler():
    """Grappler off: it happens to rewrite a rank-9 StridedSlice away, which
    hides the kernel's 8-dimension limit (users may run without it)."""
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    yield
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})


def test_a_gate_over_a_rank_9_gradient_runs(runtime, no_grappler):
    # The gate's one-op StridedSlice (every axis shrunk) has no CPU kernel
    # beyond rank 8: "Unhandled input dimensions 9" where stock runs.
    x = np.linspace(-1, 1, 512).reshape(RANK9).astype(np.float32)
    assert_matches_stock(gradients_vs_stock(runtime, _rank9_chain, {"x": x}))
