"""A keras.applications step traced with its batch unknown and known: predicted beside measured.

    python -m benchmarks.unknown_batch --models EfficientNetB0 --pixels 96 [--threads 1]

A dataset batched without drop_remainder makes Keras trace its step with the
batch unknown; the planner then counts it as 32 (`sized_shapes`) and chooses
its plan as for 16 times that (`strategies.for_any_batch`). This traces
tf.gradients' step and `"memory"`'s, each with the batch unknown and with it
static at 32, and measures every one on the same 32 images: the activation
peak in bytes requested, each weight gradient left out while it lives
(`live_set_diff.activation_peak`), against the plan's prediction. The same
model's four steps run in one fresh process per threading.

Prints one JSON line per step and writes results/unknown_batch.jsonl.
"""

import argparse
import json
import os
import subprocess
import sys

RESULTS = os.path.join(os.path.dirname(__file__), "results")
BATCH = 32
CALLS = 2  # profiled calls per step, all reported; the ratio is of the least


def measure(name, pixels):
    """Rows for `name` at `pixels`, in this process: one per (batch, method)."""
    import keras
    import numpy as np
    from benchmarks import image_models
    from benchmarks.live_set_diff import activation_peak
    from benchmarks.live_set_diff import allocator_events
    keras.utils.set_random_seed(0)
    model = image_models.application(name, pixels, classes=4)
    images = image_models.image_data(BATCH, pixels)[0].astype("float32")
    labels = (np.arange(BATCH) % 4).astype("int32")
    loss_of = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows = []
    for batch in (None, BATCH):
        for method in ("tf.gradients", "memory"):
            step, plans = _step(model, loss_of, batch, pixels, method)
            step(images, labels)  # traced outside the profiled calls
            peaks = [activation_peak(allocator_events(step, images, labels)) / 2**20
                     for _ in range(CALLS)]
            estimate = plans[0].estimate
            predicted = (estimate.baseline_bytes if method == "tf.gradients"
                         else estimate.peak_bytes) / 2**20
            rows.append({"model": name, "pixels": pixels, "traced_batch": batch,
                         "method": method, "predicted_mib": predicted,
                         "measured_mib": peaks, "predicted_over_measured": predicted / min(peaks),
                         "kept": len(plans[0].checkpoints)})
    return rows


def _step(model, loss_of, batch, pixels, method):
    """(`model`'s training step with gradients of `method`, traced with the batch
    `batch` (None: unknown), [the "memory" plan its trace made])."""
    import tensorflow as tf
    import memory_saving_gradients as msg
    plans = []

    @tf.function(input_signature=[tf.TensorSpec([batch, pixels, pixels, 3]),
                                  tf.TensorSpec([batch], tf.int32)])
    def step(x, y):
        loss = loss_of(y, model(x, training=True))
        weights = model.trainable_weights
        plans.append(msg.checkpoint_plan(loss, weights, "memory"))
        if method == "tf.gradients":
            return tf.gradients(loss, weights)
        return msg.gradients(loss, weights, checkpoints="memory")
    return step, plans


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="EfficientNetB0")
    parser.add_argument("--pixels", type=int, default=96)
    parser.add_argument("--threads", default="default,1")
    parser.add_argument("--out", default="unknown_batch")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        for row in measure(args.child, args.pixels):
            print(json.dumps(row))
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = []
    for name in args.models.split(","):
        for threads in args.threads.split(","):
            env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", PYTHONPATH=root)
            env.pop("TF_NUM_INTEROP_THREADS", None)
            if threads == "1":
                env["TF_NUM_INTEROP_THREADS"] = "1"
            out = subprocess.run([sys.executable, "-m", "benchmarks.unknown_batch", "--child",
                                  name, "--pixels", str(args.pixels)], env=env, cwd=root,
                                 capture_output=True, text=True, timeout=1800, check=True).stdout
            for line in out.strip().splitlines():
                if line.startswith("{"):
                    row = dict(json.loads(line), threads=threads)
                    lines.append(json.dumps(row))
                    print(lines[-1], flush=True)
    with open(os.path.join(RESULTS, args.out + ".jsonl"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
