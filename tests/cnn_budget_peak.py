"""A budget on a small residual CNN, measured in a fresh process (test_budget.py).

    TF_CPU_ALLOCATOR_USE_BFC=1 python -m tests.cnn_budget_peak SHARE

Budget: SHARE of tf.gradients' predicted activation memory (as the
benchmarks set budgets). Prints one JSON line: the budget, the plan's
predicted peaks (bytes requested, and as the allocator counts them), the
step's measured allocator peak (median of 3 calls after 2, weight gradients
left out) and the largest difference from tf.gradients' gradients (relative to
the largest gradient of each kernel). A fresh
process, because a BFC allocator's peak depends on what the process
allocated before (the chunks it grew and hands out whole).
"""

import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import memory_saving_gradients as msg  # noqa: E402

# 4 x 48 x 48 x 24 floats: 0.84 MiB tensors, whose chunks are not their size.
SHAPE, BLOCKS = (4, 48, 48, 24), 8


def residual_cnn():
    """(kernels, images, loss_of): BLOCKS residual 3x3 convolutions with tanh."""
    rng = np.random.RandomState(0)
    kernels = [tf.Variable(rng.randn(3, 3, SHAPE[-1], SHAPE[-1]).astype(np.float32) * 0.1)
               for _ in range(BLOCKS)]
    images = tf.constant(rng.randn(*SHAPE).astype(np.float32))

    def loss_of(x):
        h = x
        for k in kernels:
            h = h + tf.tanh(tf.nn.conv2d(h, k, 1, "SAME"))
        return tf.reduce_sum(h * h)

    return kernels, images, loss_of


def main(share):
    kernels, images, loss_of = residual_cnn()
    found = {}

    @tf.function
    def ours(x):
        loss = loss_of(x)
        baseline = msg.checkpoint_plan(loss, kernels, "speed").estimate.baseline_bytes
        budget = found["budget"] = msg.budget(share * baseline)
        found["plan"] = msg.checkpoint_plan(loss, kernels, budget)
        return msg.gradients(loss, kernels, checkpoints=budget)

    @tf.function
    def stock(x):
        return tf.gradients(loss_of(x), kernels)

    ours(images), ours(images)
    weights = sum(int(np.prod(k.shape)) * 4 for k in kernels)
    peak = statistics.median(msg.function_peak_bytes(ours, images)[0] for _ in range(3))
    error = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                for a, b in zip(ours(images), stock(images)))
    est = found["plan"].estimate
    print(json.dumps({"budget": found["budget"].max_bytes, "requested": est.peak_bytes,
                      "chunks": est.allocator_peak_bytes, "measured": peak - weights,
                      "error": error}))


if __name__ == "__main__":
    main(float(sys.argv[1]))
