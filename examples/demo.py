"""Demo: train a deep ResNet for a few steps with tf.gradients and with checkpointing.

    python -m examples.demo [--blocks 24] [--batch 32] [--steps 5]

Builds a CIFAR-style residual network from Keras layers (convolutions, batch
norm, ReLU) on synthetic 32x32x3 images, trains it inside tf.function with an
SGD optimizer, and prints the measured peak memory, activation memory and step
time of each gradient method side by side.
"""

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg

METHODS = {
    "tf.gradients": tf.gradients,
    "checkpoints='memory'": msg.gradients_memory,
    "checkpoints='speed'": msg.gradients_speed,
}


def build_resnet(blocks, channels, classes=10):
    """Keras layers of a residual CNN; returns (forward(images, training), variables)."""
    import keras  # imported here so `import memory_saving_gradients` stays light
    keras.utils.set_random_seed(0)
    stem = keras.layers.Conv2D(channels, 3, padding="same")
    body = [(keras.layers.Conv2D(channels, 3, padding="same", use_bias=False),
             keras.layers.BatchNormalization(),
             keras.layers.Conv2D(channels, 3, padding="same", use_bias=False),
             keras.layers.BatchNormalization()) for _ in range(blocks)]
    head = keras.layers.Dense(classes)

    def forward(images, training):
        h = tf.nn.relu(stem(images))
        for conv1, bn1, conv2, bn2 in body:
            r = tf.nn.relu(bn1(conv1(h), training=training))
            h = tf.nn.relu(h + bn2(conv2(r), training=training))
        return head(tf.reduce_mean(h, axis=[1, 2]))

    forward(tf.zeros([1, 32, 32, 3]), training=False)  # build the weights
    layers = [stem, head] + [layer for block in body for layer in block]
    return forward, [w for layer in layers for w in layer.trainable_weights]


def make_train_step(forward, weights, grad_fn, learning_rate=0.01):
    @tf.function
    def train_step(images, labels):
        logits = forward(images, training=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
        grads = grad_fn(loss, [w.value for w in weights])
        for w, g in zip(weights, grads):
            w.assign_sub(learning_rate * g)
        return loss
    return train_step


def run(blocks, channels, batch, steps):
    rng = np.random.default_rng(0)
    images = tf.constant(rng.normal(size=(batch, 32, 32, 3)).astype(np.float32))
    labels = tf.constant(rng.integers(0, 10, size=batch).astype(np.int32))
    forward, weights = build_resnet(blocks, channels)
    start_values = [w.numpy() for w in weights]
    weight_bytes = sum(int(np.prod(w.shape)) * 4 for w in weights)
    rows = []
    for name, grad_fn in METHODS.items():
        for w, value in zip(weights, start_values):
            w.assign(value)  # every method trains from the same weights
        step = make_train_step(forward, weights, grad_fn)
        step(images, labels)  # trace and warm up
        peak, _ = msg.function_peak_bytes(step, images, labels)
        times, losses = [], []
        for _ in range(steps):
            begin = time.perf_counter()
            losses.append(float(step(images, labels)))
            times.append(time.perf_counter() - begin)
        rows.append((name, peak, peak - weight_bytes, statistics.median(times), losses))
    return rows, weight_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16, help="residual blocks")
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method")
    args = parser.parse_args(argv)
    msg.enable_cpu_allocator_stats()  # before the first op picks the allocator
    print(f"ResNet with {args.blocks} residual blocks ({2 * args.blocks + 2} layers), "
          f"{args.channels} channels, batch {args.batch} of 32x32x3, on "
          f"{tf.config.list_logical_devices()[0].device_type}, TensorFlow {tf.__version__}")
    rows, weight_bytes = run(args.blocks, args.channels, args.batch, args.steps)
    base_act, base_time = rows[0][2], rows[0][3]
    print(f"\nweights and their gradients: {weight_bytes / 2**20:.1f} MiB each\n")
    print(f"{'method':<22} {'peak MiB':>9} {'activations MiB':>16} {'vs tf':>6} "
          f"{'step s':>7} {'vs tf':>6}  loss first -> last")
    for name, peak, act, step_time, losses in rows:
        print(f"{name:<22} {peak / 2**20:>9.1f} {act / 2**20:>16.1f} "
              f"{act / base_act:>6.2f} {step_time:>7.3f} {step_time / base_time:>6.2f}"
              f"  {losses[0]:.4f} -> {losses[-1]:.4f}")
    print("\npeak: allocator peak of one training step above what was allocated "
          "before it;\nactivations: peak minus the weight gradients.")


if __name__ == "__main__":
    main()
