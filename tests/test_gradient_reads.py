"""What an op's gradient reads: only the branches that lead to wanted gradients."""

import tensorflow as tf

from memory_saving_gradients.tfgraph import conv_gradients
from memory_saving_gradients.tfgraph import gradient_reads
from memory_saving_gradients.tfgraph import loop_memory
from memory_saving_gradients.tfgraph import reading


def test_constant_operand_branch_is_pruned():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 8))
        scaled = x * tf.constant(0.5)
    # d(x * c)/dx = dy * c reads only c; the branch for c (dy * x) reads x.
    assert gradient_reads.gradient_reads(scaled.op, (True, False)).inputs == (1,)
    assert gradient_reads.gradient_reads(scaled.op, (True, True)).inputs == (0, 1)


def test_tensor_list_has_the_bytes_of_its_items():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (16, 4, 8))
        items = tf.raw_ops.TensorListFromTensor(tensor=x, element_shape=(4, 8))
        stacked = tf.raw_ops.TensorListStack(input_handle=items, element_shape=(4, 8),
                                             element_dtype=tf.float32, num_elements=16)
    assert stacked.shape == (16, 4, 8)
    assert loop_memory.list_bytes(items) == 16 * 4 * 8 * 4
    assert loop_memory.is_float_list(items)


def test_element_wise_chain_scratch_reuses_one_buffer():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (64, 256))
        erfc = tf.math.erfc(x)
    # erfc's gradient is (dy * c) * exp(-square(x)): dy * c holds one buffer
    # while Square, Neg and Exp write into a second one (three without
    # forwarding), and the result is written over one of the two: one buffer
    # besides the result (which the timeline counts as the gradient).
    assert gradient_reads.gradient_reads(erfc.op).scratch_bytes == 64 * 256 * 4


def test_result_written_over_an_intermediate_is_no_scratch():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (8, 16, 16, 4))
        mean = tf.reduce_mean(x, [0, 1, 2], keepdims=True)
    # The mean's gradient tiles dy to x's shape and divides it in place: the
    # tiled buffer becomes the result: besides it only shape vectors (it
    # was the tiled buffer's 32 KiB).
    assert gradient_reads.gradient_reads(mean.op).scratch_bytes < 1024


def test_a_buffer_an_alias_reads_later_is_not_written_over():
    """An element-wise op reading an intermediate last writes over its buffer
    only where no tensor sharing it (a reshape of it) is read later: here the
    negation makes a buffer of its own beside exp's, which the sum reads
    through its reshape (before session 51: written over, one buffer under;
    a review's find)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (1000,))
        exp = tf.exp(x)
        rows = tf.reshape(exp, (10, 100))
        total = tf.reshape(tf.negative(exp), (10, 100)) + rows
    ops = graph.get_operations()[1:]
    # From the negation to the sum: exp's buffer and its own, and the second
    # reshape's shape vector; the sum is written over one of the two.
    assert gradient_reads._intermediate_peak(ops, {id(total)}) == 1000 * 4 + 8


def test_convolution_of_an_x_is_priced_with_its_input_gradient_and_trailing_chain():
    graph = tf.Graph()
    with graph.as_default():
        image = tf.compat.v1.placeholder(tf.float32, [8, 16, 16, 8])
        w = tf.identity(tf.ones([3, 3, 8, 8]))
        y = tf.nn.conv2d(image, w, 2, "SAME")
        model = reading.build_model([tf.reduce_sum(tf.tanh(y))], [image, w]).model
    # The image is differentiated (an x), so our gradient spreads the output
    # gradient to its grid; the filter gradient's tap chain trails.
    with_input = conv_gradients.workspace_bytes(y.op, True)
    filter_only = conv_gradients.workspace_bytes(y.op, False)
    assert with_input > filter_only > 0
    # (Besides it, the stock gradient's shape vectors: a few bytes.)
    assert with_input <= model.workspace[y.op.name] < with_input + 1024
    assert model.trailing_workspace[y.op.name] == filter_only


def test_gradients_passed_on_are_found():
    """(input, output) of each input whose gradient is that output's gradient itself."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 8))
        y = tf.compat.v1.placeholder(tf.float32, (4, 8))
        bias = tf.compat.v1.placeholder(tf.float32, (8,))
        unknown = tf.compat.v1.placeholder(tf.float32, (None, 8))
        cases = {
            x + y: ((0, 0), (1, 0)),   # `return grad, grad`
            x + bias: ((0, 0),),       # the bias' gradient is a sum
            tf.nn.bias_add(x, bias): ((0, 0),),
            x - y: ((0, 0),),          # the second gradient is negated
            x * y: (),
            unknown + x: (),           # shapes TensorFlow cannot compare: reduced
        }
        for output in cases:
            tf.identity(output)  # read: an output nobody reads gets no gradient
    for output, passed in cases.items():
        assert gradient_reads.gradient_reads(output.op).passed == passed, output.op.type
