"""One step's predicted and measured activation peak: run by tests/test_kept_root_gates.py.

    TF_CPU_ALLOCATOR_USE_BFC=1 [TF_NUM_INTEROP_THREADS=1] python -m tests.kept_root_peak

A residual chain of BLOCKS blocks h <- h + relu(tanh(bias_add(call(h @ w), b))) of
1 MiB tensors ([1024, 256] float32), where `call` is a nested tf.function reading a
variable (a StatefulPartitionedCall, as Keras' XLA grouped convolution is): the
rewrite never copies it, so its output is a kept root differentiated in a level
that recomputes nothing, between the levels above and below it. Prints
{"predicted_mib", "measured_mib"}: the "memory" plan's prediction and the
allocator's peak (median of 3) minus the weight gradients.
"""

import json

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients import measure

BLOCKS, WIDTH, BATCH = 8, 256, 1024


def residual_chain(width=WIDTH, blocks=BLOCKS, seed=0):
    """(variables, forward(x) -> loss) of the chain described above."""
    rng = np.random.default_rng(seed)
    layers = [(tf.Variable(rng.normal(scale=0.05, size=(width, width)).astype(np.float32)),
               tf.Variable(rng.normal(scale=0.1, size=width).astype(np.float32)),
               tf.Variable(np.ones(width, np.float32))) for _ in range(blocks)]

    def scaled_by(scale):
        @tf.function(autograph=False)
        def call(a):
            return a * scale
        return call

    calls = [scaled_by(scale) for _, _, scale in layers]

    def forward(x):
        h = x
        for (w, b, _), call in zip(layers, calls):
            h = h + tf.nn.relu(tf.tanh(tf.nn.bias_add(call(tf.matmul(h, w)), b)))
        return tf.reduce_sum(h * h)
    return [v for layer in layers for v in layer], forward


def main():
    variables, forward = residual_chain()
    found = {}

    @tf.function(autograph=False)
    def step(x):
        loss = forward(x)
        found["plan"] = msg.checkpoint_plan(loss, variables, "memory")
        return msg.gradients(loss, variables, checkpoints="memory")

    x = tf.constant(np.random.default_rng(1).normal(size=(BATCH, WIDTH)).astype(np.float32))
    step(x)  # traced once, outside the measured calls
    peaks = sorted(measure.function_peak_bytes(step, x)[0] for _ in range(3))
    weight_bytes = sum(int(np.prod(v.shape)) * 4 for v in variables)
    print(json.dumps({"predicted_mib": found["plan"].estimate.peak_bytes / 2**20,
                      "measured_mib": (peaks[1] - weight_bytes) / 2**20}))


if __name__ == "__main__":
    main()
