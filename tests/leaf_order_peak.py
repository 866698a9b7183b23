"""One step's measured activation peak on a residual MLP: run by tests/test_leaf_order.py.

    TF_CPU_ALLOCATOR_USE_BFC=1 [TF_NUM_INTEROP_THREADS=1] python -m tests.leaf_order_peak

16 blocks h <- h + Dense(relu(Dense(h))) of 1 MiB tensors ([1024, 256]
float32), "memory"'s gradients with a checkpoint every 8 blocks (two levels
of 8). Prints {"activation_mib": the peak of bytes requested minus the weight
gradients}, from the allocator events of one profiled call.

Bytes requested, not the allocator's peak: with the same order of allocations
BFC's peak varied by 3 MiB between processes (15.9-19.2 MiB of activations, one
thread, same requests), as the chunks it hands out depend on the regions'
layout, which is not what the order under test changes.
"""

import json

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from benchmarks.live_set_diff import allocator_events
from benchmarks.live_set_diff import requested_peak

BLOCKS, LEVEL, WIDTH, BATCH = 16, 8, 256, 1024


def main():
    rng = np.random.default_rng(0)
    layers = [(tf.Variable(rng.normal(scale=0.05, size=(WIDTH, WIDTH)).astype(np.float32)),
               tf.Variable(np.zeros(WIDTH, np.float32)),
               tf.Variable(rng.normal(scale=0.005, size=(WIDTH, WIDTH)).astype(np.float32)),
               tf.Variable(np.zeros(WIDTH, np.float32))) for _ in range(BLOCKS)]
    variables = [v for layer in layers for v in layer]

    @tf.function(autograph=False)
    def step(x):
        h, kept = x, []
        for i, (w_a, b_a, w_b, b_b) in enumerate(layers):
            a = tf.nn.relu(tf.nn.bias_add(tf.matmul(h, w_a), b_a))
            h = h + tf.nn.bias_add(tf.matmul(a, w_b), b_b)
            if i % LEVEL == LEVEL - 1 and i < BLOCKS - 1:
                kept.append(h)
        return msg.gradients([tf.reduce_sum(h * h)], variables, checkpoints=kept)

    x = tf.constant(rng.normal(size=(BATCH, WIDTH)).astype(np.float32))
    step(x)  # traced once, outside the measured calls
    peak = requested_peak(allocator_events(lambda inputs, _: step(inputs), x, None))
    weight_bytes = sum(int(np.prod(v.shape)) * 4 for v in variables)
    print(json.dumps({"activation_mib": (peak - weight_bytes) / 2**20}))


if __name__ == "__main__":
    main()
