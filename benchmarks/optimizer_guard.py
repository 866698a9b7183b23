"""The optimizer guard's case measured: an SGD step whose weight gradients
outweigh its activations, stock beside "memory" with and without the stock
fallback, in fresh processes per threading.

    python -m benchmarks.optimizer_guard [--processes 3] [--threads default,1]
                                         [--shapes 128x512,...] [--busy 0] [--out NAME]

The step (ROWSxWIDTH, 128x512 by default): 12 Keras Dense(WIDTH, relu) +
BatchNormalization layers on ROWS rows and SGD's `apply_gradients` in the
same `tf.function`, as under Keras's `fit` (12 MiB of weight gradients at 512
units; Grappler removes the IdentityN that Keras 3's optimizer puts over them
all, so each update waits for its own gradient alone). "memory" falls back to
tf.gradients there (strategies._chosen: its plan is predicted above stock with
each weight gradient taken as it is made); "memory, fallback off" is the plan
the fallback refuses.

Each process measures the three variants in turn, CALLS calls each, as the
allocator's peak (TF_CPU_ALLOCATOR_USE_BFC=1). `--busy N` runs them beside N
CPU-spinning processes (`under_load.busy`), where the executor may settle on
other orders. Rows are appended to results/NAME.jsonl; a table of the medians
and ranges in MiB is printed.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

from benchmarks import under_load

LAYERS = 12
CALLS = 3
VARIANTS = ("tf.gradients", "memory", "memory, fallback off")
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def normalized_dense_model(width):
    """The step's model (seeded): LAYERS Dense(width, relu) + BatchNormalization
    layers on `width` features, and a Dense(4) head."""
    import keras
    keras.utils.set_random_seed(7)
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(LAYERS):
        h = keras.layers.BatchNormalization()(keras.layers.Dense(width, activation="relu")(h))
    return keras.Model(inputs, keras.layers.Dense(4)(h))


def normalized_dense_step(rows, width, mode):
    """(step(x), x, found) of the step above with `mode`'s gradients (None:
    tf.gradients'); `found["plan"]` is the plan's report once traced."""
    import keras
    import tensorflow as tf

    import memory_saving_gradients as msg
    model = normalized_dense_model(width)
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    found = {}

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        weights = model.trainable_variables
        if mode is None:
            grads = tf.gradients(loss, weights)
        else:
            found["plan"] = msg.checkpoint_plan(loss, weights, mode)
            grads = msg.gradients(loss, weights, checkpoints=mode)
        optimizer.apply_gradients(zip(grads, weights))
        return loss
    return step, tf.random.stateless_normal([rows, width], [9, 9]), found


def _measure(variant, rows, width):
    """{"peaks_mib": the allocator's peak in each of CALLS calls, "stock_plan":
    the plan was stock's}."""
    import memory_saving_gradients as msg
    from memory_saving_gradients.core import strategies
    msg.enable_cpu_allocator_stats()
    strategies.STOCK_FALLBACK = variant != "memory, fallback off"
    step, x, found = normalized_dense_step(rows, width,
                                           None if variant == "tf.gradients" else "memory")
    step(x)  # traced and warmed up outside the measured calls
    peaks = [msg.function_peak_bytes(step, x)[0] / 2**20 for _ in range(CALLS)]
    plan = found.get("plan")
    return {"peaks_mib": peaks, "stock_plan": plan is None or bool(plan.plan.stock)}


def print_peaks(rows, width):
    """Prints {variant: `_measure`'s row} of the step at `rows` x `width`, as JSON."""
    print(json.dumps({variant: _measure(variant, rows, width) for variant in VARIANTS}))


def _measured_rows(args) -> list:
    """A row per (shape, threading, process, variant), each process fresh."""
    rows = []
    for shape in args.shapes.split(","):
        for threads in args.threads.split(","):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_CPU_ALLOCATOR_USE_BFC="1")
            env.pop("TF_NUM_INTEROP_THREADS", None)
            if threads != "default":
                env["TF_NUM_INTEROP_THREADS"] = threads
            for process in range(args.processes):
                done = subprocess.run(
                    [sys.executable, "-m", "benchmarks.optimizer_guard", "--child", shape],
                    env=env, check=True, timeout=1800, capture_output=True, text=True)
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                rows += [{"shape": shape, "threads": threads, "process": process,
                          "busy": args.busy, "variant": variant, **row}
                         for variant, row in measured.items()]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--threads", default="default,1",
                        help="inter-op threads per process: default or a number")
    parser.add_argument("--shapes", default="128x512", help="ROWSxWIDTH, comma-separated")
    parser.add_argument("--busy", type=int, default=0, help="CPU-spinning processes beside")
    parser.add_argument("--out", default="optimizer_guard")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return print_peaks(*map(int, args.child.split("x")))
    with under_load.busy(args.busy):
        rows = _measured_rows(args)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"{args.out}.jsonl", "a") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    print("| rows x units | threads | variant | plan | median MiB | range MiB |\n"
          "|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for threads in args.threads.split(","):
            for variant in VARIANTS:
                mine = [r for r in rows if (r["shape"], r["threads"], r["variant"])
                        == (shape, threads, variant)]
                peaks = [p for r in mine for p in r["peaks_mib"]]
                plan = "stock" if all(r["stock_plan"] for r in mine) else "rewritten"
                print(f"| {shape} | {threads} | {variant} | {plan} | "
                      f"{statistics.median(peaks):.2f} | {min(peaks):.2f}-{max(peaks):.2f} |")


if __name__ == "__main__":
    main()
