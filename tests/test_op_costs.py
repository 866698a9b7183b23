"""The FLOPs the planner prices an op's recompute at (op_kinds.op_cost)."""

import tensorflow as tf

from memory_saving_gradients.tfgraph import op_kinds


def _op(build):
    graph = tf.Graph()
    with graph.as_default():
        return build().op


def test_convolution_reads_every_input_channel_of_its_window():
    conv = _op(lambda: tf.nn.conv2d(tf.zeros([2, 8, 8, 16]), tf.zeros([3, 3, 16, 32]),
                                    strides=1, padding="SAME"))
    assert op_kinds.op_cost(conv) == 2 * (2 * 8 * 8 * 32) * (3 * 3 * 16)


def test_depthwise_convolution_reads_one_input_channel_of_its_window():
    # Counted over all input channels, MobileNetV2's depthwise convolutions
    # were priced as its costliest ops, and "memory" chose plans by that.
    depthwise = _op(lambda: tf.nn.depthwise_conv2d(
        tf.zeros([2, 8, 8, 16]), tf.zeros([3, 3, 16, 2]), strides=[1, 1, 1, 1], padding="SAME"))
    assert depthwise.type == "DepthwiseConv2dNative"
    assert op_kinds.op_cost(depthwise) == 2 * (2 * 8 * 8 * 32) * (3 * 3)


def test_matmul_counts_its_inner_dimension():
    matmul = _op(lambda: tf.matmul(tf.zeros([4, 5]), tf.zeros([5, 6])))
    assert op_kinds.op_cost(matmul) == 2 * 4 * 6 * 5
