"""Side inputs (dropout masks) are made again by the levels, not kept from the forward pass."""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import side_inputs

UNIT = 250_000  # floats: 1 MB per tensor, a dropout mask (bool) 0.25 MB
MB = 1_000_000


def _dropout_chain(depth):
    """x -> tanh(dropout(.)) `depth` times; the seed is fed, so grappler cannot fold the
    masks into constants (as Keras's seed, read from a variable, cannot be)."""
    x = tf.compat.v1.placeholder(tf.float32, [UNIT])
    seed = tf.compat.v1.placeholder(tf.int32, [2])
    h = x
    for i in range(depth):
        h = tf.tanh(tf.nn.experimental.stateless_dropout(h, 0.5, seed=seed + i))
    feed = {x: np.random.RandomState(0).randn(UNIT).astype(np.float32), seed: [3, 7]}
    return x, tf.reduce_sum(h), feed


def test_levels_make_dropout_masks_again_and_gradients_match():
    graph = tf.Graph()
    with graph.as_default():
        x, y, feed = _dropout_chain(36)
        stock = tf.gradients(y, x)
        ours = msg.gradients(y, x, checkpoints="memory")
        remade = [op for op in graph.get_operations()
                  if "recompute" in op.name and op.type == "StatelessRandomUniformV2"]
        with tf.compat.v1.Session() as sess:
            stock_peak, stock_value = msg.session_peak_bytes(sess, stock, feed)
            ours_peak, ours_value = msg.session_peak_bytes(sess, ours, feed)
    np.testing.assert_allclose(ours_value[0], stock_value[0], rtol=1e-5, atol=1e-6)
    assert remade, "no level drew its dropout mask again"
    # tf.gradients keeps 36 tanh outputs and 36 masks (45 MB). Keeping the masks
    # from the forward pass until their level, ours measured 17.6-18.1 MB (BFC
    # allocator, default threading); made again by each level, 12.6-13.6 MB.
    assert stock_peak >= 45 * MB
    assert ours_peak <= 15.5 * MB, ours_peak


def test_regenerable_needs_pure_ops_from_smaller_tensors():
    graph = tf.Graph()
    with graph.as_default():
        data = tf.compat.v1.placeholder(tf.float32, [1000])
        seed = tf.compat.v1.placeholder(tf.int32, [2])
        mask = tf.random.stateless_uniform([1000], seed) >= 0.5
        tiled = tf.tile(tf.compat.v1.placeholder(tf.float32, [10]), [100])
        drawn = tf.random.uniform([1000]) >= 0.5  # a stateful draw: never again
        side = side_inputs.SideInputs(lambda name: True)
        assert side.regenerable(mask)
        assert side.regenerable(tiled)
        assert not side.regenerable(drawn)
        assert not side.regenerable(data)  # the data itself
        assert not side.regenerable(tf.identity(data))  # nothing smaller to make it from
        inside = side_inputs.SideInputs(lambda name: name != mask.name)
        assert not inside.regenerable(mask)  # in the region or on its boundary


# Views of a ref variable's read that TensorFlow's kernels may hand on as the read's
# buffer rather than a copy (some only for some shapes: a slice along the first axis of
# rows of 64 bytes, a transpose by the identity, a zero pad).
REF_VIEWS = {
    "the read": lambda v: v,
    "a reshape": lambda v: tf.reshape(tf.reshape(v, [32]), [2, 16]),
    "a bitcast": lambda v: tf.bitcast(tf.bitcast(v, tf.int32), tf.float32),
    "ensure_shape": lambda v: tf.ensure_shape(v, [2, 16]),
    "check_numerics": lambda v: tf.debugging.check_numerics(v, "v"),
    "a slice of rows": lambda v: v[0:2],
    "an identity transpose": lambda v: tf.transpose(v, [0, 1]),
    "a zero pad": lambda v: tf.pad(v, [[0, 0], [0, 0]]),
}


@pytest.mark.parametrize("view", sorted(REF_VIEWS))
def test_side_input_sharing_a_ref_variables_buffer_is_not_made_again(view):
    """A tf.compat.v1 ref variable's read shares the variable's buffer, which an assignment
    changes in place, and so may what is computed from it: `tile(view(v))` made again after
    the step assigns `v` would see the new value, while the forward pass (and stock
    tf.gradients) used the old one."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float32, [8, 32])
        v = tf.compat.v1.Variable(np.full([2, 16], 0.5, np.float32), use_resource=False,
                                  trainable=False)
        scale = tf.tile(REF_VIEWS[view](v), [4, 2])
        weights = [tf.constant(rng.randn(32, 32).astype(np.float32) * 0.3) for _ in range(6)]
        h, tanhs = x, []
        for w in weights:
            h = tf.tanh(tf.matmul(h, w) * scale)
            tanhs.append(h)
        loss = tf.reduce_sum(h * h)
        with tf.control_dependencies([loss]):
            update = tf.compat.v1.assign_add(v, np.full([2, 16], 10.0, np.float32))
        with tf.control_dependencies([update]):
            grad_y = tf.ones_like(loss)  # backprop starts after the assignment
        stock = tf.gradients(loss, weights, grad_ys=grad_y)
        ours = msg.gradients(loss, weights, grad_ys=grad_y, checkpoints=tanhs[1::2])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            stock_value, ours_value = sess.run([stock, ours], {x: rng.randn(8, 32)})
    for s, o in zip(stock_value, ours_value):
        np.testing.assert_allclose(o, s, rtol=1e-5, atol=1e-5)


def test_ref_variable_walks_remember_every_tensor_found_free(monkeypatch):
    """Asked about the end of a chain, then about each tensor above it, the walks
    look at each tensor's dtype once (they looked at the whole chain above each)."""
    graph = tf.Graph()
    with graph.as_default():
        chain = [tf.compat.v1.placeholder(tf.float32, [4])]
        for _ in range(40):
            chain.append(tf.tanh(chain[-1]))
    looked_at = []
    is_ref = side_inputs.compat.is_ref_dtype
    monkeypatch.setattr(side_inputs.compat, "is_ref_dtype",
                        lambda dtype: looked_at.append(dtype) or is_ref(dtype))
    side = side_inputs.SideInputs(lambda name: True)
    assert not any(side._from_a_ref_variable(t)  # pylint: disable=protected-access
                   for t in reversed(chain))
    assert len(looked_at) == len(chain)
