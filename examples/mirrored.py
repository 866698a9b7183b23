"""Example: a custom training loop with checkpointing on several devices of one machine.

    python -m examples.mirrored [--devices 2] [--steps 3]

Splits the CPU into `--devices` logical devices (on a machine with GPUs,
MirroredStrategy() alone takes them all) and trains a small Keras model with
tf.distribute.MirroredStrategy: `strategy.run(step)` runs the step once per
device, each replica differentiates its own part of the batch with
`memory_saving_gradients.gradients`, and the Keras optimizer all-reduces the
gradients. The model's synchronized batch norm all-reduces its statistics in
the forward pass; checkpointing keeps such collectives, never reruns them.
The same training with stock `tf.gradients` runs next, from the same start,
and the largest difference of the final weights is printed.
"""

import argparse
import logging

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg


def build_model(width=32, depth=6):
    """A Keras MLP: tanh Dense layers, a synchronized batch norm, a linear output."""
    import keras  # imported here so `import examples.mirrored` stays light
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
        + [keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(1)])


def synthetic_data(global_batch, width=32):
    """The same endless regression batches in every process."""
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((4 * global_batch, width)).astype(np.float32)
    targets = np.sin(inputs.sum(axis=1, keepdims=True)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((inputs, targets)).batch(global_batch).repeat()


def train(strategy, grad_fn, steps, global_batch):
    """Trains `steps` SGD steps under `strategy` with `grad_fn` as tf.gradients.

    Returns the final trainable weights as numpy arrays.
    """
    import keras
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(learning_rate=0.05)

    @tf.function
    def train_step(inputs, targets):
        def replica_step(inputs, targets):
            predictions = model(inputs, training=True)
            per_example = tf.reduce_sum(tf.square(predictions - targets), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = grad_fn(loss, [w.value for w in model.trainable_variables])
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica_step, args=(inputs, targets))

    batches = iter(strategy.experimental_distribute_dataset(synthetic_data(global_batch)))
    for _ in range(steps):
        train_step(*next(batches))
    return [w.numpy() for w in model.trainable_variables]


def split_cpu(devices):
    """Makes `devices` logical CPU devices; call before TensorFlow runs any op."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
    return [device.name for device in tf.config.list_logical_devices("CPU")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512, help="global batch size")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("memory_saving_gradients").setLevel(logging.INFO)  # print the plans
    strategy = tf.distribute.MirroredStrategy(split_cpu(args.devices))
    ours = train(strategy, msg.gradients_memory, args.steps, args.batch)
    stock = train(strategy, tf.gradients, args.steps, args.batch)
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, stock))
    print(f"{args.steps} steps on {strategy.num_replicas_in_sync} replicas; largest "
          f"weight difference checkpointing vs tf.gradients: {difference:.2e}")
    return difference


if __name__ == "__main__":
    main()
