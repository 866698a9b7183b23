"""max_pool_grad_grad: second orders through max pools without the CPU
MaxPoolGradGrad kernel, which returns zeros when it takes its `grad` input's
buffer as its output (pools whose output has their input's shape)."""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import max_pool_grad_grad

IMAGE = np.random.RandomState(0).randn(2, 5, 5, 3)


def pooled_loss(x):
    return tf.reduce_sum(tf.square(tf.nn.max_pool2d(x * 1.3, 2, 1, "SAME")))


def gradient_penalty(first):
    return tf.reduce_sum(tf.square(first))


def _second_order(x, first_order, second_order):
    first, = first_order(pooled_loss(x), [x])
    return second_order(gradient_penalty(first), [x])[0]


def eager_reference(image, loss_of=pooled_loss):
    """d penalty(d loss / dx) / dx by nested tapes: eagerly the `grad` buffer
    is held by Python, never forwarded."""
    x = tf.constant(image)
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            loss = loss_of(x)
        penalty = gradient_penalty(inner.gradient(loss, x))
    return outer.gradient(penalty, x).numpy()


def _finite_differences(image, eps=1e-6):
    """d penalty / d x by central differences of the (first-order, correct) gradient."""
    def penalty(value):
        x = tf.constant(value)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = pooled_loss(x)
        return gradient_penalty(tape.gradient(loss, x)).numpy()
    result = np.zeros_like(image)
    for index in np.ndindex(*image.shape):
        step = np.zeros_like(image)
        step[index] = eps
        result[index] = (penalty(image + step) - penalty(image - step)) / (2 * eps)
    return result


def _run(runtime, first_order, second_order):
    if runtime == "function":
        step = tf.function(lambda x: _second_order(x, first_order, second_order))
        return step(tf.constant(IMAGE)).numpy()
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float64, IMAGE.shape)
        result = _second_order(x, first_order, second_order)
        with tf.compat.v1.Session() as session:
            return session.run(result, {x: IMAGE})


def _ours(ys, xs):
    return msg.gradients(ys, xs, checkpoints=[])


@pytest.mark.parametrize("runtime", ["function", "session"])
def test_stock_second_order_through_stride_one_same_pool_is_zero(runtime):
    """The TensorFlow bug itself (TF 2.16 and 2.21: zeros 10 runs in 10). If this
    fails, TensorFlow's kernel no longer forwards the buffer: see whether
    max_pool_grad_grad.py is still needed."""
    reference = eager_reference(IMAGE)
    assert np.count_nonzero(reference) > 50
    results = [_run(runtime, tf.gradients, tf.gradients) for _ in range(3)]
    assert any(np.count_nonzero(r) == 0 for r in results)


@pytest.mark.parametrize("runtime", ["function", "session"])
@pytest.mark.parametrize("first", ["stock", "ours"])
def test_our_second_order_matches_eager_tapes_and_finite_differences(runtime, first):
    reference = eager_reference(IMAGE)
    np.testing.assert_allclose(reference, _finite_differences(IMAGE), rtol=1e-5, atol=1e-6)
    first_order = tf.gradients if first == "stock" else _ours
    for _ in range(3):  # the stock kernel's failure depends on the schedule
        np.testing.assert_allclose(_run(runtime, first_order, _ours), reference,
                                   rtol=1e-12, atol=1e-12)


def _max_pool_grad(x, pooled, v, ksize, strides, padding, v2):
    kwargs = dict(orig_input=x, orig_output=pooled, grad=v, padding=padding,
                  ksize=[1, *ksize, 1], strides=[1, *strides, 1])
    return tf.raw_ops.MaxPoolGradV2(**kwargs) if v2 else tf.raw_ops.MaxPoolGrad(**kwargs)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
@pytest.mark.parametrize("ksize, strides, padding, size, v2", [
    ((2, 2), (1, 1), "SAME", 5, False), ((3, 2), (1, 1), "SAME", 6, True),
    ((1, 1), (1, 1), "VALID", 4, False), ((2, 2), (2, 2), "SAME", 1, False),
    ((3, 3), (2, 1), "SAME", 7, False), ((2, 3), (1, 2), "VALID", 7, True)])
def test_our_gradient_is_the_adjoint_of_max_pool_grad_with_ties(dtype, ksize, strides,
                                                                 padding, size, v2):
    """<MaxPoolGrad(v), g> == <v, ours(g)>: our gradient reads g where
    MaxPoolGrad routed v, at the first of tied maxima too (integer inputs tie
    in most windows); batch 3, so the argmax's batch index matters. Exact:
    small integers. Ours on every pool; the affected ones are those whose
    output has their input's shape."""
    rng = np.random.default_rng(7)
    image = np.maximum(rng.integers(-2, 3, [3, size, size, 2]), 0)
    with tf.Graph().as_default():
        x = tf.constant(image, dtype)
        pooled = tf.nn.max_pool2d(x, list(ksize), list(strides), padding)
        v_value = rng.integers(-3, 4, pooled.shape)
        g_value = rng.integers(-3, 4, x.shape)
        v = tf.constant(v_value, dtype)
        routed = _max_pool_grad(x, pooled, v, ksize, strides, padding, v2)
        assert max_pool_grad_grad.is_affected(routed.op) == (pooled.shape == x.shape)
        with compat.gradients_overridden([routed.op], max_pool_grad_grad.ARGMAX_GRADIENT):
            ours = tf.gradients(routed, v, grad_ys=tf.constant(g_value, dtype))[0]
        assert "MaxPoolGradGrad" not in {op.type for op in ours.graph.get_operations()}
        with tf.compat.v1.Session() as session:
            routed, ours = session.run([tf.cast(routed, tf.float64), tf.cast(ours, tf.float64)])
    assert np.count_nonzero(ours) > 0 and np.count_nonzero(routed) > 0
    assert np.sum(routed * g_value) == np.sum(v_value * ours)


def test_not_under_xla_nor_for_nchw_or_explicit_padding():
    @tf.function(jit_compile=True)
    def compiled(x):
        first = tf.gradients(tf.reduce_sum(tf.nn.max_pool2d(x, 2, 1, "SAME")), x)[0]
        return max_pool_grad_grad.is_affected(first.op)

    assert not compiled(tf.zeros([1, 4, 4, 1]))
    with tf.Graph().as_default():
        x = tf.zeros([1, 4, 4, 1])
        pooled = tf.nn.max_pool2d(x, 2, 1, "SAME")
        for changes in [dict(data_format="NCHW"),
                        dict(padding="EXPLICIT", explicit_paddings=[0, 0, 0, 1, 0, 1, 0, 0])]:
            kwargs = dict(orig_input=x, orig_output=pooled, grad=pooled, ksize=[1, 2, 2, 1],
                          strides=[1, 1, 1, 1], padding="SAME")
            routed = tf.raw_ops.MaxPoolGrad(**{**kwargs, **changes})
            assert not max_pool_grad_grad.is_affected(routed.op)


@pytest.mark.stock_fallback
def test_our_second_order_where_the_plan_leaves_it_to_tf_gradients():
    """On this toy graph no plan is predicted below tf.gradients: the call is
    stock tf.gradients (rewrite.backprop's plan.stock), which must get our
    gradient too."""
    reference = eager_reference(IMAGE)
    def second_order(ys, xs):
        return msg.gradients(ys, xs, checkpoints="memory")
    for _ in range(3):
        np.testing.assert_allclose(_run("function", tf.gradients, second_order), reference,
                                   rtol=1e-12, atol=1e-12)
