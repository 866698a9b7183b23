"""float8 tensors between checkpoints: the rewrite's waits on dtypes with no arithmetic.

tf.gradients sends no gradient through float8 (not a trainable dtype), but
a model may hold float8 activations (x -> float8 -> back, a quantised
matmul input). Under XLA a level's stubs of kept float tensors wait for
the level's gate by adding a zero made from it (`gradient_waits.wait_for_gate`);
float8_* have no AddV2 nor Mul, and the rewrite failed with a TypeError.
Gates read one element of each gradient and compare it (NotEqual), which
float8 has no kernel for either, and int4 no slice.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import dtypes

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import gradient_waits

FLOAT8 = [dtypes.float8_e4m3fn, dtypes.float8_e5m2]


def _forward(x, w, dtype):
    """Six residual tanh(matmul) blocks, each output also cast to `dtype` and
    back (no gradient crosses that path); the float8 tensors."""
    h, eights = x, []
    for i in range(6):
        t = tf.tanh(tf.matmul(h, w))
        eights.append(tf.cast(t, dtype))
        h = h + tf.cast(eights[-1], tf.float32) * float(i + 2) + 0.5 * t
    return tf.reduce_sum(h), eights


@pytest.mark.parametrize("dtype", FLOAT8, ids=lambda d: d.name)
@pytest.mark.parametrize("jit", [False, True], ids=["function", "xla"])
@pytest.mark.parametrize("kind", ["float8 kept", "memory"])
def test_float8_activations_gradients_match_tf_gradients(dtype, jit, kind):
    w = tf.Variable(np.random.RandomState(0).randn(16, 16).astype(np.float32) * 0.3)

    @tf.function(jit_compile=jit)
    def step(x):
        loss, eights = _forward(x, w, dtype)
        checkpoints = eights[1::2] if kind == "float8 kept" else "memory"
        return (msg.gradients(loss, [w, x], checkpoints=checkpoints),
                tf.gradients(loss, [w, x]))

    ours, stock = step(tf.constant(np.random.RandomState(1).randn(8, 16).astype(np.float32)))
    for mine, theirs in zip(ours, stock):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", FLOAT8, ids=lambda d: d.name)
def test_gates_and_waits_on_dtypes_with_no_arithmetic_run(dtype):
    """A gate over such tensors (beside a float32 one, or alone) and a wait on one run."""

    @tf.function
    def waits():
        odd = tf.cast(tf.ones([2, 3]), dtype)
        gates = [gradient_waits.gate([odd, tf.ones([4])]), gradient_waits.gate([odd])]
        waited = gradient_waits.wait_for_gate(odd, gates[0])
        return gates, tf.cast(waited, tf.float32)

    gates, waited = waits()
    assert [bool(g) for g in gates] == [False, False]
    np.testing.assert_array_equal(waited.numpy(), np.ones([2, 3]))
