"""Stock tf.gradients' peak on a chain of 16 `tf.nn.silu` in a tf.function: run by
tests/test_captured_reads.py.

    TF_CPU_ALLOCATOR_USE_BFC=1 python -m tests.silu_stock_peak

x -> (x * w_i -> silu) * 16 -> sum, x of 32 rows (about 1 MB), scalar weights,
traced with its rows known and with them unknown (the planner then assumes 32,
`sized_shapes`), and with them known beside an op writing its input in place.
Prints {"known" | "unknown" | "in_place": {"predicted_mb": the planner's
prediction of tf.gradients' activation peak, "measured_mb": the peak of bytes
requested over one profiled call}}. Grappler's constant folding makes silu's
early `beta * features` (beta = 1) an Identity here, the rows known or not:
nothing is held for it (measured 33 MB, 48 with the folding off); beside an
in-place op, a Snapshot, which copies it (`identity_folding`).
"""

import json

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from benchmarks.live_set_diff import allocator_events
from benchmarks.live_set_diff import requested_peak

ROWS, COLUMNS, DEPTH = 32, 7813, 16


def measured(rows, weights, x, in_place=False):
    """(predicted, measured) MB of stock's step traced with `rows` rows (None:
    unknown), and `in_place`, an `InplaceAdd` of a small tensor in the step."""
    plans = []

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([rows, COLUMNS])])
    def step(x):
        node = x
        for w in weights:
            node = tf.nn.silu(node * w)
        small = tf.zeros([2, 3]) + weights[0]
        if in_place:
            small = tf.raw_ops.InplaceAdd(x=small, i=[0], v=tf.ones([1, 3]))
        y = tf.reduce_sum(node)
        plans.append(msg.checkpoint_plan(y, weights, "memory"))
        return tf.gradients(y, weights), small

    step(x)  # traced once, outside the measured call
    peak = requested_peak(allocator_events(lambda inputs, _: step(inputs), x, None))
    return {"predicted_mb": plans[0].estimate.baseline_bytes / 1e6, "measured_mb": peak / 1e6}


def main():
    weights = [tf.Variable(1.0 + 0.01 * i) for i in range(DEPTH)]
    x = tf.constant(np.random.default_rng(0).normal(size=(ROWS, COLUMNS)).astype(np.float32))
    print(json.dumps({"known": measured(ROWS, weights, x),
                      "unknown": measured(None, weights, x),
                      "in_place": measured(ROWS, weights, x, in_place=True)}))


if __name__ == "__main__":
    main()
