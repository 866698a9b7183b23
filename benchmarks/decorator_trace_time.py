"""Trace time of a tape training step with every layer `@recompute_grad`, against stock.

    python -m benchmarks.decorator_trace_time [--layers 25,50,100,200] [--width 32]
        [--out benchmarks/results/decorator_trace_time.md]

A stack of N residual blocks (`h + Dense(width, relu)(h)`, one Keras layer
each), a `tf.GradientTape` step with momentum SGD, traced with
`get_concrete_function` (no run). Each (N, method) is traced in a fresh
process: "stock" has the decorator switched off (RECOMPUTE=0), "decorated"
switched on (RECOMPUTE=1), so each block's gradient is a recomputed
segment. The seconds are the trace's wall time; the ratio is decorated over
stock at the same N. The decorator's own work per layer should not grow
with the layers above it: its time per layer (the last column) stays flat
when the whole trace is near-linear in N.
"""

import argparse
import json
import os
import subprocess
import sys
import time


def trace_seconds(layers: int, width: int) -> float:
    """Wall seconds to trace the step (in this process, switch from the environment)."""
    import keras
    import tensorflow as tf

    from memory_saving_gradients.keras import recompute_grad

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(width, activation="relu")

        @recompute_grad
        def call(self, h):
            return h + self.dense(h)

    keras.utils.set_random_seed(0)
    blocks = [Block() for _ in range(layers)]
    head = keras.layers.Dense(1)
    optimizer = keras.optimizers.SGD(1e-3, momentum=0.9)
    x = tf.random.normal((16, width))
    h = x
    for block in blocks:
        h = block(h)
    head(h)
    weights = [w for layer in blocks + [head] for w in layer.trainable_weights]
    optimizer.build(weights)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for block in blocks:
                h = block(h)
            loss = tf.reduce_mean(head(h) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return loss

    start = time.perf_counter()
    step.get_concrete_function(tf.TensorSpec(x.shape, x.dtype))
    return time.perf_counter() - start


def measure(layers: int, width: int, decorated: bool) -> float:
    """trace_seconds in a fresh process, with the switch set."""
    env = dict(os.environ, RECOMPUTE="1" if decorated else "0", TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-m", "benchmarks.decorator_trace_time", "--worker",
                          str(layers), "--width", str(width)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="25,50,100,200")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps({"seconds": trace_seconds(args.worker, args.width)}))
        return
    lines = ["| layers | stock s | decorated s | ratio | decorated - stock, ms per layer |",
             "| --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for layers in (int(n) for n in args.layers.split(",")):
        stock = measure(layers, args.width, decorated=False)
        decorated = measure(layers, args.width, decorated=True)
        per_layer_ms = 1000 * (decorated - stock) / layers
        lines.append(f"| {layers} | {stock:.2f} | {decorated:.2f} | {decorated / stock:.2f} "
                     f"| {per_layer_ms:.0f} |")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
