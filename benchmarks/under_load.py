"""Peaks of one step in many fresh processes while other processes load the CPUs.

With one inter-op thread TensorFlow's executor runs cheap ops inline and queues
costly ones, and which ops count as costly it learns from their measured run
times: under load a process may settle on another order than its neighbours,
and keep it for every step. A saving that holds in most processes and not in
some shows only over many of them.

    python -m benchmarks.under_load [--runs 12] [--busy 2] [--threads 1]

The case: eight bias-free Dense(1024) layers decorated with `@recompute_grad`
under RECOMPUTE=1, 256 rows, a GradientTape step with momentum SGD that
returns the loss. Methods, interleaved run by run: the layers undecorated
(stock), decorated, and decorated with the next layer not held for the
updates of the layer above (`update_waits.hold_next_levels_for_updates` off,
as before session 57). Each process traces the step, then takes the allocator
peak (above the memory held before it) of four steps; the table gives, per
method, how many processes peaked above the stock median, and their peaks.
TensorFlow's own CPU kernels (TF_ENABLE_ONEDNN_OPTS=0) unless the environment
says otherwise, as the tests measure.

Writes benchmarks/results/under_load.json (or --out) and prints a table.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

METHODS = ("stock", "decorated", "decorated, next layer not held")
RESULTS = os.path.join(os.path.dirname(__file__), "results", "under_load.json")
LAYERS, WIDTH, ROWS = 8, 1024, 256


def measure(method, threads, steps=4):
    """Runs in the child process: the step's peaks in MiB, one per step."""
    import tensorflow as tf
    if threads:
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    import keras

    import memory_saving_gradients as msg
    import memory_saving_gradients.keras  # noqa: F401  (msg.keras)
    from memory_saving_gradients.integrations import layer_decorator
    from memory_saving_gradients.tfgraph import update_waits
    msg.enable_cpu_allocator_stats()

    class RecomputedDense(keras.layers.Dense):
        @msg.keras.recompute_grad
        def call(self, inputs):
            return super().call(inputs)

    layer = keras.layers.Dense
    if method != "stock":
        layer_decorator._ENV_ON = True  # pylint: disable=protected-access  # RECOMPUTE=1
        layer = RecomputedDense
    if method == "decorated, next layer not held":
        update_waits.hold_next_levels_for_updates = lambda gradients, ops: 0
    step, x = dense_stack_step(layer)
    step(x)
    return [msg.function_peak_bytes(step, x)[0] / 2**20 for _ in range(steps)]


def dense_stack(layer, activation=None):
    """LAYERS bias-free `layer(WIDTH, activation)`, from fixed seeds."""
    import keras
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((WIDTH,))] + [
        layer(WIDTH, activation, use_bias=False) for _ in range(LAYERS)])


def dense_stack_step(layer, rows=ROWS, activation=None, returns="loss"):
    """(a traced-on-call training step, its batch): `dense_stack`, momentum
    SGD, a GradientTape step returning the loss or the gradients it applies
    (`returns`)."""
    import keras
    import numpy as np
    import tensorflow as tf
    model = dense_stack(layer, activation)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss, "gradients": grads}[returns]

    x = np.linspace(-1, 1, rows * WIDTH, dtype=np.float32).reshape(rows, WIDTH)
    return step, tf.constant(x)


@contextlib.contextmanager
def busy(count):
    """`count` processes spinning on a CPU each, while the block runs."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(count)]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12, help="processes per method")
    parser.add_argument("--busy", type=int, default=2, help="CPU-spinning processes beside")
    parser.add_argument("--threads", type=int, default=1,
                        help="inter-op threads (0: TensorFlow's default)")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.threads)))
        return
    child_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                     TF_ENABLE_ONEDNN_OPTS=os.environ.get("TF_ENABLE_ONEDNN_OPTS", "0"))
    peaks = {method: [] for method in METHODS}
    with busy(args.busy):
        for run in range(args.runs):
            for method in METHODS:
                done = subprocess.run(
                    [sys.executable, "-m", "benchmarks.under_load", "--child", method,
                     "--threads", str(args.threads)],
                    capture_output=True, text=True, check=True, env=child_env)
                peaks[method].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"run {run + 1}: {method}: {peaks[method][-1]}", flush=True)
    line = statistics.median(max(p) for p in peaks["stock"])
    print(f"\n{args.runs} processes per method, {args.busy} busy, threads={args.threads}; "
          f"each process's largest step peak, MiB (stock median {line:.1f})")
    print("| method | processes above stock's median | peaks |\n|---|---|---|")
    for method, runs in peaks.items():
        largest = sorted(max(p) for p in runs)
        above = sum(p > line for p in largest)
        print(f"| {method} | {above} of {len(largest)} | "
              f"{', '.join(f'{p:.0f}' for p in largest)} |")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"runs": args.runs, "busy": args.busy, "threads": args.threads,
                   "peaks_mib": peaks}, f, indent=1)


if __name__ == "__main__":
    main()
