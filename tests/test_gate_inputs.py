"""A gate runs over gradients of any rank (0-10), size (empty included),
static shape (known, partly or wholly unknown) and numeric dtype, with
Grappler off (it rewrites some slices away, hiding kernel limits)."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from memory_saving_gradients.tfgraph import gradient_waits

DTYPES = (tf.float32, tf.float64, tf.bfloat16, tf.int32, tf.uint8, tf.complex64)


@pytest.fixture(scope="module", autouse=True)
def no_grappler():
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    yield
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})


_gradient = st.tuples(st.lists(st.integers(0, 3), max_size=10),
                      st.sampled_from(DTYPES), st.sampled_from(("known", "partial", "none")),
                      st.booleans())


@settings(max_examples=30, deadline=None)
@given(st.lists(_gradient, min_size=1, max_size=4))
def test_a_gate_runs_and_is_true_only_for_a_nan_first_element(gradients):
    graph = tf.Graph()
    with graph.as_default():
        feeds, tensors, expected = {}, [], False
        for shape, dtype, static, nan in gradients:
            value = np.full(shape, np.nan if nan and dtype.is_floating else 1.0)
            expected |= bool(value.size) and nan and dtype.is_floating
            known = {"known": shape, "partial": [None] * len(shape), "none": None}[static]
            feed = tf.compat.v1.placeholder(tf.float64, known)
            feeds[feed] = value
            tensors.append(tf.cast(feed, dtype))
        gate = gradient_waits.gate(tensors)
        with tf.compat.v1.Session(graph=graph) as session:
            assert session.run(gate, feeds) == expected
