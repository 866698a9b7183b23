"""Whole Keras image models of the benchmarks: keras.applications and U-Nets.

Unlike the families of `models.py` these have no residual blocks of our own to
cut by hand: each is one Keras model, built from scratch (`weights=None`, no
download), whose logits go to a cross-entropy loss. The classifiers predict
one of `classes` labels per image, the U-Nets one per pixel.
"""

import numpy as np

APPLICATIONS = ("MobileNetV2", "EfficientNetB0", "DenseNet121", "ResNet50", "ConvNeXtTiny")
# keras.applications models no plan was tuned on (first measured in session 42,
# docs/planner.md), at the smallest side each takes (Xception 71, InceptionV3 75).
HELD_OUT = {"MobileNetV3Small": 64, "VGG16": 64, "ResNet50V2": 64, "EfficientNetV2B0": 64,
            "Xception": 80, "InceptionV3": 80,
            # first measured in session 60 (benchmarks/results/s60_held_out_600b003.md)
            "NASNetMobile": 64, "MobileNetV3Large": 64, "DenseNet169": 64,
            # first measured in session 70 (benchmarks/results/s70_held_out3_0e687b6.md)
            "MobileNet": 64, "ResNet101": 64,
            # first measured in session 73 (benchmarks/results/s73_held_out_*.md)
            "VGG19": 64, "ResNet152V2": 64, "DenseNet201": 64, "InceptionResNetV2": 80,
            "EfficientNetB2": 64, "ConvNeXtSmall": 64}


def application(name, pixels, classes=10):
    """keras.applications.<name> on pixels x pixels x 3 images, random weights, logits."""
    import keras
    return getattr(keras.applications, name)(
        weights=None, input_shape=(pixels, pixels, 3), classes=classes,
        classifier_activation=None)


def unet_classic(pixels, classes=3, depth=3, width=16):
    """The concatenating U-Net: two conv-BN-ReLU per stage, max pooling on the way
    down, transposed convolutions on the way up, skips joined by concatenation."""
    import keras
    layers = keras.layers

    def stage(h, channels):
        for _ in range(2):
            h = layers.Conv2D(channels, 3, padding="same")(h)
            h = layers.ReLU()(layers.BatchNormalization()(h))
        return h

    inputs = keras.Input((pixels, pixels, 3))
    skips, h = [], inputs
    for level in range(depth):
        h = stage(h, width << level)
        skips.append(h)
        h = layers.MaxPooling2D()(h)
    h = stage(h, width << depth)
    for level in reversed(range(depth)):
        h = layers.Conv2DTranspose(width << level, 2, strides=2)(h)
        h = stage(layers.Concatenate()([h, skips[level]]), width << level)
    return keras.Model(inputs, layers.Conv2D(classes, 1)(h), name="unet_classic")


def unet_keras_io(pixels, classes=3, widths=(64, 128, 256)):
    """The U-Net-like shape of keras.io's Oxford-pets segmentation example: a strided
    stem, separable-conv blocks going down and transposed-conv blocks going up, each
    with a residual projection added (not concatenated), then a per-pixel classifier."""
    import keras
    layers = keras.layers

    def conv_bn(h, conv):
        return layers.BatchNormalization()(conv(layers.Activation("relu")(h)))

    inputs = keras.Input((pixels, pixels, 3))
    h = layers.Conv2D(32, 3, strides=2, padding="same")(inputs)
    h = layers.Activation("relu")(layers.BatchNormalization()(h))
    residual = h
    for channels in widths:
        for _ in range(2):
            h = conv_bn(h, layers.SeparableConv2D(channels, 3, padding="same"))
        h = layers.MaxPooling2D(3, strides=2, padding="same")(h)
        residual = layers.Conv2D(channels, 1, strides=2, padding="same")(residual)
        h = residual = layers.add([h, residual])
    for channels in tuple(reversed(widths)) + (32,):
        for _ in range(2):
            h = conv_bn(h, layers.Conv2DTranspose(channels, 3, padding="same"))
        h = layers.UpSampling2D(2)(h)
        residual = layers.Conv2D(channels, 1, padding="same")(layers.UpSampling2D(2)(residual))
        h = residual = layers.add([h, residual])
    logits = layers.Conv2D(classes, 3, padding="same")(h)
    return keras.Model(inputs, logits, name="unet_keras_io")


def image_data(batch, pixels, classes=10, per_pixel=False):
    """(images, labels) from a fixed seed; labels per image, or per pixel."""
    rng = np.random.default_rng(0)
    labels_shape = (batch, pixels, pixels) if per_pixel else (batch,)
    return (rng.normal(size=(batch, pixels, pixels, 3)).astype(np.float32),
            rng.integers(0, classes, size=labels_shape).astype(np.int32))
