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


def _grad_ops(convolve, image, kernel):
    """The ops of the gradient of sum(convolve(image, kernel)**2), by type."""
    graph = tf.Graph()
    with graph.as_default():
        x, f = tf.ones(image), tf.ones(kernel)
        y = convolve(x, f)
        tf.gradients(tf.reduce_sum(y * y), [x, f])
    return {op.type: op for op in graph.get_operations()}


def test_transposed_convolution_multiplies_each_input_element_by_the_kernel():
    # A stride-2 transposed convolution (Keras Conv2DTranspose, U-Net's up
    # path): each of the 2x8x8x32 input elements meets 3x3x16 taps. Counted
    # over its 2x16x16x16 output it was priced 4 * 16 / 32 = 2 times that.
    up = _op(lambda: tf.nn.conv2d_transpose(tf.zeros([2, 8, 8, 32]), tf.zeros([3, 3, 16, 32]),
                                            [2, 16, 16, 16], strides=2, padding="SAME"))
    assert up.type == "Conv2DBackpropInput"
    assert op_kinds.op_cost(up) == 2 * (2 * 8 * 8 * 32) * (3 * 3 * 16)


def test_convolution_backprops_cost_what_the_convolution_costs():
    # As second orders differentiate them: the filter backprop was priced at
    # 2 products per filter element (its second input is a shape), 2 * 4 * 4
    # = 32 times too low here (batch times output pixels on a real net).
    ops = _grad_ops(lambda x, f: tf.nn.conv2d(x, f, 2, "SAME"), [2, 8, 8, 16], [3, 3, 16, 32])
    forward = 2 * (2 * 4 * 4 * 32) * (3 * 3 * 16)
    assert op_kinds.op_cost(ops["Conv2D"]) == forward
    assert op_kinds.op_cost(ops["Conv2DBackpropInput"]) == forward
    assert op_kinds.op_cost(ops["Conv2DBackpropFilter"]) == forward


def test_depthwise_convolution_backprops_cost_what_the_convolution_costs():
    ops = _grad_ops(lambda x, f: tf.nn.depthwise_conv2d(x, f, [1, 2, 2, 1], "SAME"),
                    [2, 8, 8, 16], [3, 3, 16, 2])
    forward = 2 * (2 * 4 * 4 * 32) * (3 * 3)
    assert op_kinds.op_cost(ops["DepthwiseConv2dNative"]) == forward
    assert op_kinds.op_cost(ops["DepthwiseConv2dNativeBackpropInput"]) == forward
    assert op_kinds.op_cost(ops["DepthwiseConv2dNativeBackpropFilter"]) == forward


def test_3d_convolution_and_its_backprops():
    ops = _grad_ops(lambda x, f: tf.nn.conv3d(x, f, [1, 1, 2, 2, 1], "SAME"),
                    [2, 4, 8, 8, 16], [3, 3, 3, 16, 32])
    forward = 2 * (2 * 4 * 4 * 4 * 32) * (3 * 3 * 3 * 16)
    assert {t: op_kinds.op_cost(ops[t]) for t in ops if t.startswith("Conv3D")} == {
        "Conv3D": forward, "Conv3DBackpropInputV2": forward, "Conv3DBackpropFilterV2": forward}


def test_grouped_convolution_reads_its_group_of_input_channels():
    # tf.nn.conv2d groups by the filter's input depth (4 of the 16 channels).
    grouped = _op(lambda: tf.nn.conv2d(tf.zeros([2, 8, 8, 16]), tf.zeros([3, 3, 4, 32]),
                                       strides=1, padding="SAME"))
    assert op_kinds.op_cost(grouped) == 2 * (2 * 8 * 8 * 32) * (3 * 3 * 4)


def test_einsum_counts_every_index_of_its_contraction():
    # Attention scores as the GPT-2 and Llama benchmarks write them: one
    # product per (b, h, q, k, d); priced at its output size before, 64x low here.
    scores = _op(lambda: tf.einsum("bqhd,bkhd->bhqk", tf.zeros([2, 16, 4, 64]),
                                   tf.zeros([2, 16, 4, 64])))
    assert scores.type == "Einsum"
    assert op_kinds.op_cost(scores) == 2 * (2 * 4 * 16 * 16) * 64


def test_einsum_with_an_ellipsis_is_priced_at_its_output():
    batched = _op(lambda: tf.einsum("...ij,...jk->...ik", tf.zeros([3, 4, 5]),
                                    tf.zeros([3, 5, 6])))
    assert batched.type == "Einsum"
    assert op_kinds.op_cost(batched) == 3 * 4 * 6
