"""Activation memory of a tape step over decorated Keras LSTM blocks.

    python -m benchmarks.decorated_lstm_memory MODE STEPS [plain] [one-thread]

MODE: "decorated" (each block's call under @recompute_grad) or "stock"
(the same blocks undecorated). The step runs inside `msg.checkpointing()`
unless "plain" is given (TensorFlow alone); "one-thread" runs TensorFlow's
ops on one inter-op thread (the executor's order then decides the peak). Prints the forward While ops'
output counts (differentiating a loop adds its accumulators as outputs) and
the allocator peak of three steps above the memory in use before each,
less the weight gradients (design handbook, section 4). Four residual
blocks, LSTM(128), batch 32; run each mode in its own process.
"""

import contextlib
import sys

import numpy as np
import tensorflow as tf
import keras

import memory_saving_gradients as msg
from memory_saving_gradients.keras import recompute_grad

UNITS, BATCH, BLOCKS = 128, 32, 4


class Block(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.lstm = keras.layers.LSTM(units, return_sequences=True)

    def call(self, x):
        return x + self.lstm(x)


class DecoratedBlock(Block):
    @recompute_grad
    def call(self, x):
        return super().call(x)


def main(mode: str, steps: int, plain: bool, one_thread: bool) -> None:
    if one_thread:
        tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    blocks = [(DecoratedBlock if mode == "decorated" else Block)(UNITS)
              for _ in range(BLOCKS)]
    x = tf.random.normal([BATCH, steps, UNITS])
    h = x
    for block in blocks:
        h = block(h)
    weights = [w for block in blocks for w in block.trainable_weights]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for block in blocks:
                h = block(h)
            loss = tf.reduce_sum(h ** 2)
        return tape.gradient(loss, weights)

    with contextlib.nullcontext() if plain else msg.checkpointing():
        graph = step.get_concrete_function(x).graph
        outputs = [len(op.outputs) for op in graph.get_operations()
                   if op.type in ("While", "StatelessWhile")]
        step(x)
        peaks = []
        for _ in range(3):
            tf.config.experimental.reset_memory_stats("CPU:0")
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            step(x)
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    weight_bytes = sum(int(np.prod(w.shape)) * 4 for w in weights)
    print(f"{mode}{' plain' if plain else ''}{' one-thread' if one_thread else ''}, "
          f"{steps} steps: the first {BLOCKS} While ops' "
          f"outputs {outputs[:BLOCKS]} ({len(outputs)} While ops); "
          f"activation MiB {[round((p - weight_bytes) / 2**20, 1) for p in peaks]}")


if __name__ == "__main__":
    options = sys.argv[3:]
    unknown = set(options) - {"plain", "one-thread"}
    if unknown:
        sys.exit(f"unknown options {sorted(unknown)}: expected 'plain' and/or 'one-thread'")
    main(sys.argv[1], int(sys.argv[2]), "plain" in options, "one-thread" in options)
