"""Ops that would not rerun identically are never recomputed (issue 14, item 2).

`effects.reruns_identically` is checked against every op type TensorFlow
registers, and numerically on the random ops that TensorFlow does not flag
stateful (fractional pooling draws new pooling regions on every run).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from harness import Model
from harness import assert_matches_stock
from harness import gradients_vs_stock
from memory_saving_gradients.tfgraph import effects

# Registered op types whose names suggest randomness but that rerun
# identically: they take their seed (or key) as an input tensor, or compute
# deterministic math on samples. Everything else with such a name must be
# classified as not rerunning identically.
_DETERMINISTIC_DESPITE_NAME = frozenset({
    "RandomGammaGrad",  # derivative of a gamma sample, plain math
    "RandomIndexShuffle",  # a permutation of an index fixed by its seed input
    "SobolSample",  # a quasi-random, deterministic sequence
    "FractionalMaxPoolGrad", "FractionalAvgPoolGrad",  # regions given as inputs
    "ShuffleDataset", "ShuffleAndRepeatDataset",  # seeds as inputs; variant outputs
})
_RANDOM_WORDS = ("Random", "Shuffle", "Sample", "Sampler", "Multinomial", "Fractional")


def _registered_op_defs():
    for name in dir(tf.raw_ops):
        op_def = op_def_registry.get(name)
        if op_def is not None:
            yield name, op_def


def test_every_seeded_op_type_is_not_rerun():
    seeded = [name for name, op_def in _registered_op_defs()
              if effects.draws_random_numbers(op_def)]
    # TensorFlow's own random ops and the ones it does not flag stateful.
    assert {"RandomUniform", "TruncatedNormal", "Multinomial", "RandomShuffle",
            "FractionalMaxPool", "FractionalAvgPool"} <= set(seeded)
    rerun = [name for name, op_def in _registered_op_defs()
             if name in seeded and effects.reruns_identically(op_def)]
    assert rerun == []


def test_every_random_looking_op_type_is_seeded_stateful_or_known_deterministic():
    wrong = [name for name, op_def in _registered_op_defs()
             if any(word in name for word in _RANDOM_WORDS)
             and not name.startswith("Stateless")
             and name not in _DETERMINISTIC_DESPITE_NAME
             and effects.reruns_identically(op_def)]
    assert wrong == [], f"op types that may draw random numbers yet count as rerunnable: {wrong}"


def test_stateless_random_ops_rerun_identically():
    for name in ("StatelessRandomUniformV2", "StatelessRandomNormal", "StatelessMultinomial"):
        assert effects.reruns_identically(op_def_registry.get(name)), name


@pytest.mark.parametrize("pool", [tf.nn.fractional_max_pool, tf.nn.fractional_avg_pool])
@pytest.mark.parametrize("runtime", ["session", "function"])  # XLA has no fractional pooling
def test_fractional_pooling_between_recomputed_segments(runtime, pool):
    def build(ctx, x):
        w = ctx.variable("w", np.full([3, 3, 2, 2], 0.2, np.float32))
        h = tf.tanh(tf.nn.conv2d(x, w, 1, "SAME"))
        pooled = pool(tf.sin(h), [1.0, 1.7, 1.7, 1.0], pseudo_random=True)[0]
        out = tf.tanh(pooled * 2.0)
        y = tf.reduce_sum(tf.square(out) * tf.range(1.0, 3.0))
        # h and out are checkpoints: the pool between them is in a segment.
        return Model(ys=[y], xs=[x, w], lists={"around_pool": [h, out]})

    x = np.random.RandomState(0).randn(2, 9, 9, 2).astype(np.float32)
    outcome = gradients_vs_stock(runtime, build, {"x": x}, modes=("memory",))
    assert_matches_stock(outcome, forward_unchanged=False)


def test_recomputability_is_asked_by_op_type():
    """`op_kinds.is_recomputable` asks `effects.type_reruns_identically` (one
    registry look-up per op type): a call of a graph function by its own op
    type is no registered type, so it is kept, as are random ops."""
    from tensorflow.python.framework import function

    from memory_saving_gradients.tfgraph import op_kinds

    with tf.Graph().as_default():
        @function.Defun(tf.float32)
        def twice(x):
            return x * 2.0

        x = tf.compat.v1.placeholder(tf.float32, (3,))
        call = twice(x).op
        assert op_def_registry.get(call.type) is None
        assert not effects.type_reruns_identically(call.type)
        assert not op_kinds.is_recomputable(call)
        assert not op_kinds.is_recomputable(tf.random.uniform((3,)).op)
        assert op_kinds.is_recomputable(tf.tanh(x).op)
