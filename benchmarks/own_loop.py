"""A user's own training loop (a GradientTape step in tf.function, then the
optimizer's `apply_gradients`) traced inside `checkpointing`, against the same
loop stock: peak memory and step time.

Each (model, method) runs in a fresh process. Every step after the first
(which traces) is measured alone (allocator peak above the memory held before
it); the table gives the largest peak and the median time. The models and
optimizers are `keras_fit`'s.

    python -m benchmarks.own_loop --models EfficientNetV2B0,MobileNetV3Large \\
        --optimizer sgd-momentum --returns nothing
    python -m benchmarks.own_loop --threads 1 ...   # one inter-op thread

`--returns nothing` is a step that returns no value: TensorFlow then keeps
the `IdentityN` Keras's optimizer puts over all the gradients, so stock holds
every weight gradient until the last is made; `--returns loss` returns the
loss, as `fit`'s step does.

Writes benchmarks/results/own_loop.json (or --out) and prints a table.
"""

import argparse
import importlib
import json
import os
import statistics
import time

from benchmarks import keras_fit

METHODS = {"stock tape": None, "checkpointing(memory)": "memory",
           "checkpointing(memory), updates as stock": "memory, updates as stock",
           "checkpointing(memory), ranked held": "memory, ranked held",
           "checkpointing(memory), next level not held": "memory, next level not held"}
# "memory" with parts of the library switched off: the module, and what each
# of its functions named returns instead.
SWITCHED_OFF = {
    # The optimizer's update as stock makes it: no IdentityN passed by, nothing
    # waiting for a gradient nor held for (tfgraph/update_waits.py).
    "memory, updates as stock": ("tfgraph.update_waits", {
        "wait_for_gradients": 0, "pass_gradients_straight": 0,
        "hold_next_levels_for_updates": 0}),
    # Plans ranked with every weight gradient held, as before session 56 (the
    # optimizer's taking each gradient one by one never noted).
    "memory, ranked held": ("integrations.optimizer_waits", {"_note_taken_one_by_one": None}),
    # The next level not held for the updates of the level above, as before
    # session 57.
    "memory, next level not held": ("tfgraph.update_waits",
                                    {"hold_next_levels_for_updates": 0}),
}
RESULTS = os.path.join(os.path.dirname(__file__), "results", "own_loop.json")


def measure(model_name, checkpoints, steps, returns, threads=0, optimizer="adam"):
    """Runs in the child process; returns one result row."""
    import tensorflow as tf
    if threads:
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    import memory_saving_gradients as msg
    msg.enable_cpu_allocator_stats()
    import contextlib
    import keras

    if checkpoints in SWITCHED_OFF:
        module, returns_instead = SWITCHED_OFF[checkpoints]
        switched = importlib.import_module(f"memory_saving_gradients.{module}")
        for name, value in returns_instead.items():
            setattr(switched, name, lambda *args, value=value, **kwargs: value)
        checkpoints = "memory"
    model, x, y = keras_fit.build(model_name, optimizer)
    optimizer = model.optimizer
    loss_of = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss if returns == "loss" else None

    x, y = tf.constant(x), tf.constant(y)
    with msg.checkpointing(checkpoints) if checkpoints else contextlib.nullcontext():
        step(x, y)
    peaks, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        peaks.append(msg.function_peak_bytes(step, x, y)[0])
        times.append(time.perf_counter() - start)
    return {"peak_mib": max(peaks) / 2**20, "step_s": statistics.median(times),
            "grad_mib": sum(w.numpy().nbytes for w in model.trainable_weights) / 2**20}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="EfficientNetV2B0,MobileNetV3Large",
                        help="keras_fit's models or keras.applications names")
    parser.add_argument("--returns", choices=("nothing", "loss"), default="nothing")
    parser.add_argument("--out", default=RESULTS)
    keras_fit.add_step_arguments(parser, METHODS, "sgd-momentum")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], METHODS[args.child[1]], args.steps,
                                 args.returns, args.threads, args.optimizer)))
        return
    rows = keras_fit.measured_rows("benchmarks.own_loop", args, "returns")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
