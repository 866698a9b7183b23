"""Stock tf.gradients' activation memory with and without XLA's depthwise temporary.

    python -m benchmarks.native_depthwise_baseline MODEL [--threads 1]

Keras runs a grouped Conv2D as an XLA-compiled call whose CPU gradient holds
two K x K x C x C arrays (tfgraph/grouped_conv_calls.py); our gradients take
TensorFlow's native depthwise kernels instead. This prints the measured peak
(MiB, weight gradients left out, median of 3 calls) of one stock tf.gradients
step as Keras builds it, and of the same step with only those calls
differentiated natively (what a user gets by building the model with
DepthwiseConv2D layers): the second is the baseline that isolates what
checkpointing saves. MODEL as in `benchmarks.predicted_vs_measured`.
"""

import argparse
import os
import statistics


def main():
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", default="default")
    args = parser.parse_args()
    import tensorflow as tf
    import memory_saving_gradients as msg
    from benchmarks import predicted_vs_measured as pvm
    from memory_saving_gradients.tfgraph import grouped_conv_calls
    model, inputs, labels = pvm.model_and_data(args.model, args.threads)
    weights = {}

    def step(native):
        @tf.function(autograph=False)
        def run(inputs, labels):
            loss, xs = pvm.loss_and_weights(model, inputs, labels)
            weights["all"] = xs
            ops = tf.compat.v1.get_default_graph().get_operations() if native else []
            with grouped_conv_calls.native_gradients(ops):
                return tf.gradients(loss, xs)
        return run

    for name, native in (("tf.gradients", False), ("tf.gradients, native depthwise", True)):
        run = step(native)
        run(inputs, labels)
        outputs = sum(w.numpy().nbytes for w in weights["all"])
        peaks = [msg.function_peak_bytes(run, inputs, labels)[0] - outputs for _ in range(3)]
        print(f"{args.model} threads={args.threads} {name}: "
              f"{statistics.median(peaks) / 2 ** 20:.1f} MiB")


if __name__ == "__main__":
    main()
