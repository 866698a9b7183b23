"""How many weight gradients a training step holds at once: Keras 3's `fit`
and its optimizer's `apply_gradients` against a step updating each variable
from its own gradient, with Grappler's dependency optimizer on and off.

    python -m benchmarks.weight_gradient_lifetimes [--layers 8] [--width 2048]

The model: LAYERS bias-free Dense(WIDTH) layers on 8 rows, so each weight
gradient (WIDTH**2 floats) outweighs everything else the step makes. Each
cell runs in a fresh process (BFC allocator statistics; the least peak of
three steps after a warm-up one) for oneDNN off and on, TensorFlow's default
threading and one inter-op thread; it prints the peak in weight gradients
(peak bytes / one gradient's bytes).

Keras 3's optimizer puts one IdentityN over every gradient before its updates;
Grappler's dependency optimizer removes it where the step returns a value (as
`fit`'s does), so each update waits for its own gradient alone
(`strategies.AS_TAKEN`, the count `"memory"` ranks by under `fit`). In a
`tf.function` that returns nothing, or with that optimizer off, the
`apply_gradients` step holds all LAYERS gradients.
"""

import argparse
import json
import itertools

# How each step applies its gradients; the tf.function steps return the loss
# unless said.
STEPS = ("fit", "apply_gradients", "apply_gradients, nothing returned", "assign_sub each")


def peak_in_gradients(step, layers, width, dependency_optimization):
    """Runs in the child process: the least allocator peak of three calls of
    `step` (one of STEPS), in units of one weight gradient."""
    import numpy as np

    import memory_saving_gradients as msg
    msg.enable_cpu_allocator_stats()
    import keras
    import tensorflow as tf
    tf.config.optimizer.set_experimental_options(
        {"dependency_optimization": dependency_optimization})
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((width,))] + [
        keras.layers.Dense(width, use_bias=False) for _ in range(layers)])
    x = np.ones((8, width), np.float32)
    optimizer = keras.optimizers.SGD(0.01)
    if step == "fit":
        model.compile(optimizer, "mse")

        def run():
            model.fit(x, x, batch_size=8, epochs=1, verbose=0)
    else:
        optimizer.build(model.trainable_variables)

        @tf.function
        def run():
            loss = tf.reduce_mean(tf.square(model(x) - x))
            weights = model.trainable_variables
            grads = tf.gradients(loss, weights)
            if step.startswith("apply_gradients"):
                optimizer.apply_gradients(zip(grads, weights))
            else:
                for weight, grad in zip(weights, grads):
                    weight.assign_sub(0.01 * grad)
            return None if step.endswith("nothing returned") else loss
    run()
    peak = min(msg.function_peak_bytes(run)[0] for _ in range(3))
    return {"gradients": peak / (width * width * 4)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(peak_in_gradients(args.child[0], args.layers, args.width,
                                           args.child[1] == "on")))
        return
    from benchmarks import keras_fit
    print(f"{args.layers} Dense({args.width}) layers: the step's peak in weight gradients\n\n"
          "| oneDNN | inter-op threads | dependency optimizer | "
          + " | ".join(STEPS) + " |\n|---|---|---|" + "---|" * len(STEPS))
    for onednn, threads, dependency in itertools.product(("0", "1"), ("default", "1"),
                                                         ("on", "off")):
        env = {"TF_ENABLE_ONEDNN_OPTS": onednn, "TF_CPP_MIN_LOG_LEVEL": "3",
               "TF_CPU_ALLOCATOR_USE_BFC": "1",
               "TF_NUM_INTEROP_THREADS": None if threads == "default" else threads}
        cells = [keras_fit.child_row(
            "benchmarks.weight_gradient_lifetimes",
            ["--layers", str(args.layers), "--width", str(args.width), "--child", step,
             dependency], timeout=900, env=env)["gradients"] for step in STEPS]
        print(f"| {'on' if onednn == '1' else 'off'} | {threads} | {dependency} | "
              + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
