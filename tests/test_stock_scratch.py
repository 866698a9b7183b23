"""tf.gradients' own convolution gradient kernels, as the model counts their scratch.

With several inter-op threads TensorFlow's executor runs a convolution's
input and filter gradients at once, so stock's step holds both kernels'
scratch (ResNet50 at 64 px: two 20 MiB buffers at its peak; predicted 0.80 of
the measured activation peak when one was counted, 0.99 with both). The
rewrite chains them (tfgraph/gradient_order.py), so its own count is the
larger one. A gradient op tf.gradients does not build (a first
convolution's input gradient) counts nothing.
"""

import pytest
import tensorflow as tf

from memory_saving_gradients.tfgraph import reading
from memory_saving_gradients.tfgraph import workspace


def _conv_model(differentiate_image):
    graph = tf.Graph()
    with graph.as_default():
        image = tf.tanh(tf.compat.v1.placeholder(tf.float32, [8, 16, 16, 48]))
        w = tf.identity(tf.ones([1, 1, 48, 48]))
        # Explicit padding keeps TensorFlow's own gradient kernels (not conv_gradients').
        y = tf.nn.conv2d(image, w, 1, [[0, 0]] * 4)
        xs = [w, image] if differentiate_image else [w]
        return reading.build_model([tf.reduce_sum(tf.tanh(y))], xs).model, y.op.name


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("differentiate_image", [True, False])
def test_stock_counts_both_kernels_scratch_with_several_threads(
        threads, differentiate_image, monkeypatch):
    if not workspace.stock_kernels_take_scratch():
        pytest.skip("this host's kernels take no scratch (oneDNN)")
    monkeypatch.setattr(workspace, "several_inter_op_threads", lambda: threads > 1)
    model, conv = _conv_model(differentiate_image)
    ours = model.workspace[conv]
    stock = model.stock_workspace.get(conv, ours)
    assert ours > 2**20  # the larger kernel's scratch, the rewrite running one at a time
    if threads > 1 and differentiate_image:
        # A 1x1 convolution's two kernels take as much (14 MiB on 8 16x16 images of 48
        # channels, on the host measured).
        assert stock > 1.5 * ours, (stock, ours)
    else:
        assert stock == ours, (stock, ours)
