"""Keras `model.fit` with the Checkpointing callback against stock `fit`: peak memory and time.

Each (model, method) runs in a fresh process (peak statistics only go up in
a process). A measuring callback resets the CPU allocator's statistics before
every training batch and reads the peak after it; batches after the first
(which traces) give the peak and the median step time. The planner's promise
for the same train step is read from the plan `gradients` logs while Keras
traces it.

    python -m benchmarks.keras_fit                    # three models: 10-40 min on 2 shared cores
    python -m benchmarks.keras_fit --models cnn --steps 4
    python -m benchmarks.keras_fit --data dataset     # a tf.data pipeline: batch unknown
    python -m benchmarks.keras_fit --models ResNet50,DenseNet121   # keras.applications
    python -m benchmarks.keras_fit --models dense_bn --optimizer sgd   # optimizer_guard's

`--data dataset` feeds `fit` a tf.data dataset batched without
drop_remainder, as most input pipelines are: Keras then traces its step with
the batch dimension unknown (arrays give it a static one).

Writes benchmarks/results/keras_fit.json and prints a table.
"""

import argparse
import json
import logging
import os
import re
import subprocess
import sys

from benchmarks import image_models
from benchmarks import optimizer_guard
from examples import keras_models

METHODS = {"fit": None, "fit + Checkpointing(memory)": "memory",
           "fit + Checkpointing(speed)": "speed",
           # The same step without the tape: gradients(memory) called directly, to show
           # what the integration costs (nothing, if it equals Checkpointing(memory)).
           "fit, train_step calling gradients(memory)": "direct",
           # What the optimizer's work that needs no gradient costs when it runs at the
           # step's start (tfgraph/update_waits.py switched off; not in the default run).
           "fit + Checkpointing(memory), updates not waiting": "memory, updates not waiting"}
DEFAULT_METHODS = tuple(m for m in METHODS if "not waiting" not in m)
OPTIMIZERS = {"adam": lambda k: "adam", "sgd": lambda k: k.optimizers.SGD(0.01),
              "sgd-momentum": lambda k: k.optimizers.SGD(0.01, momentum=0.9),
              "adamw": lambda k: k.optimizers.AdamW(), "rmsprop": lambda k: k.optimizers.RMSprop()}
DEFAULT_MODELS = ("cnn", "bert", "convnext")
MODELS = DEFAULT_MODELS + ("dense_bn",)
RESULTS = os.path.join(os.path.dirname(__file__), "results", "keras_fit.json")


def build(name, optimizer="adam"):
    """The model and one batch: MobileNetV2 (batch norm), a BERT-like encoder,
    ConvNeXtTiny (grouped convolutions: XLA-compiled calls), optimizer_guard's
    normalized dense layers on 128 rows (its weight gradients outweigh its
    activations), or any other
    keras.applications model by its name, on 32 images of 96 pixels as
    MobileNetV2: activations must outweigh the weights' gradients, which the
    activation ratio subtracts (ResNet50 on 8 images of 64 pixels: 90 MiB of
    them, beside a step's peak of 87)."""
    import keras
    import numpy as np
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    if name not in MODELS and hasattr(keras.applications, name):
        model = image_models.application(name, 96, classes=4)
        x, _ = image_models.image_data(32, 96)
    elif name == "cnn":
        model = keras_models.mobilenet(size=96)
        x = rng.rand(32, 96, 96, 3).astype("float32")
    elif name == "convnext":
        model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(64, 64, 3),
                                                classes=4, include_preprocessing=False)
        x = rng.rand(8, 64, 64, 3).astype("float32")
    elif name == "dense_bn":  # weight gradients outweigh its activations
        model = optimizer_guard.normalized_dense_model(512)
        x = rng.randn(128, 512).astype("float32")
    elif name == "bert":
        model = keras_models.bert_like(vocab=1000, width=128, layers=4)
        x = rng.randint(1, 1000, (16, 128))
    else:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)} or the name of "
                         f"a keras.applications model")
    y = rng.randint(0, 4, len(x))
    model.compile(optimizer=OPTIMIZERS[optimizer](keras),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x, y


def measure(model_name, checkpoints, steps, data, threads=0, optimizer="adam"):
    """Runs in the child process: fit `steps` batches of arrays or of a
    dataset (`data`), stock (`checkpoints` None), with `gradients` in the train
    step ("direct") or with the Checkpointing callback (any other `checkpoints`:
    a mode or a strategy callable), with `threads` inter-op threads (0:
    TensorFlow's default) and one of OPTIMIZERS; returns one result row."""
    import tensorflow as tf
    if threads:
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    import memory_saving_gradients as msg
    msg.enable_cpu_allocator_stats()
    import numpy as np
    import memory_saving_gradients.keras as msg_keras
    plans = []
    handler = logging.Handler()
    handler.emit = lambda record: plans.append(record.getMessage())
    logging.getLogger("memory_saving_gradients").addHandler(handler)
    logging.getLogger("memory_saving_gradients").setLevel(logging.INFO)

    if checkpoints == "memory, updates not waiting":
        from memory_saving_gradients.tfgraph import update_waits
        update_waits.wait_for_gradients = lambda gradients, ops: 0
        checkpoints = "memory"
    model, x, y = build(model_name, optimizer)
    if checkpoints == "direct":
        object.__setattr__(model, "train_step", _direct_train_step(model))
    meter = keras_models.step_meter()
    callbacks = [meter] + ([msg_keras.Checkpointing(checkpoints)]
                           if checkpoints not in (None, "direct") else [])
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    if data == "dataset":
        model.fit(tf.data.Dataset.from_tensor_slices((xs, ys)).batch(len(x)), epochs=1,
                  verbose=0, callbacks=callbacks)
    else:
        model.fit(xs, ys, batch_size=len(x), epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)
    peak, step_s = meter.summary()
    simulated = [float(m) / 100 for p in plans
                 for m in re.findall(r"tf\.gradients \((\d+)%\)", p)]
    return {"peak_mib": peak / 2**20, "step_s": step_s,
            "grad_mib": sum(w.numpy().nbytes for w in model.trainable_weights) / 2**20,
            "simulated_ratio": simulated[-1] if simulated else None}


def _direct_train_step(model):
    """Keras's train step, with gradients(memory) in place of the tape."""
    import memory_saving_gradients as msg

    def train_step(data):
        x, y = data
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
        weights = model.trainable_weights
        grads = msg.gradients(loss, weights, checkpoints="memory")
        model.optimizer.apply_gradients(zip(grads, weights))
        return {"loss": loss}
    return train_step


def ratios(row, stock):
    """`row`'s step against `stock`'s: the whole peak, the activations (the peak
    less all the weights' gradients) and the median step time.

    The weight gradients are made during backprop, so the activation ratio
    subtracts gradients that need not all be alive at either peak: where they
    are large, the whole peak's ratio is the one to read (session 48's
    ResNets: 0.18-0.27 of stock's activations, 0.32-0.42 of its whole peak, the
    planner's ratio 0.36-0.38).
    """
    return {"peak_ratio": row["peak_mib"] / stock["peak_mib"],
            "activation_ratio": ((row["peak_mib"] - row["grad_mib"])
                                 / (stock["peak_mib"] - stock["grad_mib"])),
            "time_ratio": row["step_s"] / stock["step_s"]}


def child_row(module, args, timeout, env=None):
    """Runs `python -m <module> <args>` in a fresh process (this checkout first on
    the path; `env`: variables to set, or to unset where None) and returns the
    JSON row its last line of output prints."""
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    for name, value in (env or {}).items():
        child_env.pop(name, None)
        if value is not None:
            child_env[name] = value
    out = subprocess.run([sys.executable, "-m", module, *args], env=child_env,
                         capture_output=True, text=True, timeout=timeout, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def add_step_arguments(parser, methods, optimizer):
    """The arguments of a step's measurement that this benchmark and own_loop share."""
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--methods", default=";".join(methods),
                        help="';'-separated; ratios are against the first")
    parser.add_argument("--threads", type=int, default=0,
                        help="inter-op threads (0: TensorFlow's default)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=optimizer)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)


def measured_rows(module, args, variant):
    """Runs `python -m <module> --child MODEL METHOD ...` for each model and
    method of `args`, passing on the steps, threads, optimizer and the
    argument named `variant` (the kind of step); prints each row beside the
    model's first method and returns the rows."""
    rows = []
    for model_name in args.models.split(","):
        stock = None
        for method in args.methods.split(";"):
            row = {"model": model_name, "method": method, variant: getattr(args, variant),
                   "threads": args.threads, "optimizer": args.optimizer,
                   **child_row(module, ["--child", model_name, method,
                                        "--steps", str(args.steps),
                                        f"--{variant}", getattr(args, variant),
                                        "--threads", str(args.threads),
                                        "--optimizer", args.optimizer], timeout=900)}
            stock = stock or row
            row.update(ratios(row, stock))
            rows.append(row)
            planner = row.get("simulated_ratio")
            print(f"{model_name:16} {method:48} peak {row['peak_mib']:7.1f} MiB "
                  f"x{row['peak_ratio']:.2f}, activations x{row['activation_ratio']:.2f} "
                  f"(planner {planner if planner is not None else '-'}) "
                  f"step {row['step_s']:.3f} s x{row['time_ratio']:.2f}", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="of " + ", ".join(MODELS) + " or keras.applications names")
    parser.add_argument("--data", choices=("arrays", "dataset"), default="arrays",
                        help="arrays: the batch static when traced; dataset: unknown")
    parser.add_argument("--out", default=RESULTS)
    add_step_arguments(parser, DEFAULT_METHODS, "adam")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], METHODS[args.child[1]], args.steps,
                                 args.data, args.threads, args.optimizer)))
        return
    rows = measured_rows("benchmarks.keras_fit", args, "data")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
