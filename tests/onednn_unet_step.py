"""The classic U-Net's "speed" and "memory" steps with oneDNN's kernels on and
images of unknown size, in a fresh process (test_onednn_hosts.py).

    TF_ENABLE_ONEDNN_OPTS=1 python -m tests.onednn_unet_step

With unknown spatial sizes no convolution takes our scratch-free gradient,
so every level differentiates its convolutions with the stock kernels. A
level's filter gradient then reads the gradient the level above handed down,
which that level's bias gradient also reads; oneDNN's layout pass merges the
two. Prints one JSON line per mode: the largest difference from
tf.gradients' gradients (relative to the largest of all: the convolutions' biases,
followed by batch norms, have gradients of zero up to rounding), or the error.
"""

import json

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from benchmarks.image_models import unet_classic


def main():
    tf.random.set_seed(0)
    model = unet_classic(None, depth=2, width=8)
    images = tf.random.normal([8, 32, 32, 3])
    labels = tf.random.uniform([8, 32, 32], maxval=3, dtype=tf.int32)

    def loss_of(x, y):
        return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True), from_logits=True))

    signature = [tf.TensorSpec([8, None, None, 3]), tf.TensorSpec([8, None, None], tf.int32)]

    @tf.function(input_signature=signature)
    def stock(x, y):
        return tf.gradients(loss_of(x, y), model.trainable_weights)

    expected = stock(images, labels)
    for mode in ("speed", "memory"):
        @tf.function(input_signature=signature)
        def ours(x, y):
            return msg.gradients(loss_of(x, y), model.trainable_weights, checkpoints=mode)
        try:
            got = ours(images, labels)
            row = {"mode": mode, "error": max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected))
                   / max(float(np.max(np.abs(b))) for b in expected)}
        except tf.errors.InvalidArgumentError as error:
            row = {"mode": mode, "failed": error.message.splitlines()[0]}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
