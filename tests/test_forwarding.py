"""Kernels writing their output over an input they read last, measured and predicted.

TensorFlow's element-wise CPU kernels take an input's buffer for their
output when nothing else holds it (`forward_input_or_allocate_output`).
`op_kinds.FORWARDING_OP_TYPES` lists the op types the timeline lets do so;
each is measured here: in a tf.function, an op of that type reads a 1 MiB
intermediate `a` (and a second one, `c`, kept to the end), and the step's
peak of the bytes requested is 2 MiB when the output takes `a`'s buffer, 3 MiB when it
gets one of its own (as `tf.roll`'s does, the control). Control edges make
`c` exist while the op runs and be read after it, whatever the threading.

Everything measured here is measured in a fresh process (this file run as
`__main__`): in the suite's process, after a Session run traced with
FULL_TRACE (`session_peak_bytes`), TensorFlow forwarded nothing any more.
"""

import dataclasses
import json

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import control_flow_v1
from tests.harness import module_result

from memory_saving_gradients.core import timeline
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import profiled_allocations
from memory_saving_gradients.tfgraph import reading
from memory_saving_gradients.tfgraph import sized_shapes

MIB = 2 ** 20
SHAPE = (256, 1024)  # float32: 1 MiB
# The scalars our gates make (an element of each tensor waited for, their flags)
# are not modelled: a few bytes per level, alive beside the buffers.
GATE_SCALARS = 1024

# Op type -> its call on (a, c), two [256, 1024] float32 tensors; others
# are called as unary ops on `a` or binary ones on (a, c).
_CALLS = {
    "BiasAdd": lambda a, c: tf.raw_ops.BiasAdd(value=a, bias=c[0]),
    "AddN": lambda a, c: tf.raw_ops.AddN(inputs=[a, c]),
    "Select": lambda a, c: tf.raw_ops.Select(condition=c > 0, x=a, y=c),
    "SelectV2": lambda a, c: tf.raw_ops.SelectV2(condition=c > 0, t=a, e=c),
    "ClipByValue": lambda a, c: tf.raw_ops.ClipByValue(
        t=a, clip_value_min=-1.0, clip_value_max=1.0),
    "Roll": lambda a, c: tf.roll(a, 1, 0),  # the control: a buffer of its own
    # Outputs of `op_kinds._FORWARDING_OUTPUTS`: the backprop over the logits.
    "SparseSoftmaxCrossEntropyWithLogits":
        lambda a, c: tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(
            features=a, labels=tf.zeros(SHAPE[:1], tf.int32))[1],
}
_ARGUMENT_NAMES = (("x",), ("features",), ("logits",), ("x", "y"), ("gradients", "features"),
                   ("gradients", "outputs"), ("y", "dy"))


def _call(op_type, a, c):
    if op_type in _CALLS:
        return _CALLS[op_type](a, c)
    kernel = getattr(tf.raw_ops, op_type)
    for names in _ARGUMENT_NAMES:
        try:
            return kernel(**dict(zip(names, (a, c))))
        except TypeError:  # not this op's argument names
            continue
    raise TypeError(f"no call for {op_type}")


def _peak_mib(op_type):
    first = tf.Variable(tf.random.normal(SHAPE, seed=1))
    second = tf.Variable(tf.random.normal(SHAPE, seed=2))

    @tf.function
    def step():
        a = tf.roll(first, 1, 0)  # intermediates: rolled, not folded by Grappler
        c = tf.roll(second, 1, 0)
        with tf.control_dependencies([c]):  # c exists while the op runs, and after
            out = _call(op_type, a, c)
        with tf.control_dependencies([out]):
            return tf.reduce_sum(out) + tf.reduce_sum(c)

    step()
    # Bytes requested, profiled: the allocator's own peak counts BFC's chunks,
    # which can be a whole buffer larger (Sqrt measured 3 MiB after 40 kernels).
    held = []
    events = profiled_allocations.allocator_events(lambda: held.append(step()))
    return profiled_allocations.requested_peak(events) / MIB


FORWARDING = sorted(op_kinds.FORWARDING_OP_TYPES | set(op_kinds._FORWARDING_OUTPUTS))


@pytest.fixture(scope="module")
def measured():
    """What `_measure_all` returns, from a fresh process."""
    return module_result("tests.test_forwarding", "default")


@pytest.mark.parametrize("op_type", FORWARDING)
def test_listed_kernels_write_over_an_input_they_read_last(measured, op_type):
    assert measured["kernels"][op_type] == pytest.approx(2.0, abs=0.3)


def test_a_kernel_that_does_not_forward_takes_a_buffer_of_its_own(measured):
    assert measured["kernels"]["Roll"] == pytest.approx(3.0, abs=0.3)


def test_the_reading_records_forwardable_inputs_and_gradients():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8])
        w = tf.Variable(tf.ones([8]))
        h = x * w
        r = tf.nn.relu(h)
        s = r * r  # reads r twice: held twice, never forwarded
        t = tf.tanh(s)
        y = tf.reduce_sum(t)
        model = reading.build_model([y], [w.handle]).model
    assert model.forwarding[r.op.name] == ((r.name, (h.name,)),)
    assert s.op.name not in model.forwarding
    assert model.forwarding[t.op.name] == ((t.name, (s.name,)),)
    # ReluGrad(dy, y) may write over the incoming gradient or the ReLU's output;
    # TanhGrad(y, dy) over the tanh's output or its incoming gradient.
    assert model.forwarded_grads[r.op.name] == (
        (h.name, (("grad", r.name), ("value", r.name))),)
    assert model.forwarded_grads[t.op.name] == (
        (s.name, (("value", t.name), ("grad", t.name))),)


def test_unknown_dimensions_in_the_same_places_are_taken_to_match():
    """(The batch, unknown when traced, is the same in both.) An unknown rank
    never matches."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 8])
        scaled = x * 2.0
        relu = tf.nn.relu(scaled).op
        assert _names(op_kinds.forwardable_inputs(relu)) == [(relu.outputs[0].name,
                                                              [scaled.name])]
        anything = tf.compat.v1.placeholder(tf.float32, None)
        assert op_kinds.forwardable_inputs(tf.nn.relu(anything * 2.0).op) == []
        fixed = tf.compat.v1.placeholder(tf.float32, [4, 8])
        bias = tf.compat.v1.placeholder(tf.float32, [8])
        added = tf.nn.bias_add(fixed, bias).op
        assert _names(op_kinds.forwardable_inputs(added)) == [(added.outputs[0].name, [fixed.name])]
        assert op_kinds.forwardable_inputs(tf.matmul(fixed, fixed, transpose_b=True).op) == []
        labels = tf.compat.v1.placeholder(tf.int32, [4])
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=fixed).op
        assert _names(op_kinds.forwardable_inputs(xent)) == [(xent.outputs[1].name, [fixed.name])]


def test_an_unknown_dimension_matches_the_size_the_planner_assumes_for_it():
    """A custom gradient's closure reads the original tensor, of unknown batch,
    beside a gradient probe's stand-ins sized as the planner assumes (32): a
    product of the two may be written over either (before session 50, over the
    stand-in alone: EfficientNetB0's swish gradients with the batch unknown
    were priced a buffer under measured). Other sizes still do not match."""
    graph = tf.Graph()
    with graph.as_default():
        unknown = tf.compat.v1.placeholder(tf.float32, [None, 8])
        assumed = tf.compat.v1.placeholder(tf.float32, [sized_shapes.UNKNOWN_DIM_SIZE, 8])
        product = (tf.sigmoid(unknown) * assumed).op
        assert _names(op_kinds.forwardable_inputs(product)) == [
            (product.outputs[0].name, [product.inputs[0].name, assumed.name])]
        other = tf.compat.v1.placeholder(tf.float32, [sized_shapes.UNKNOWN_DIM_SIZE + 1, 8])
        mixed = tf.add(tf.sigmoid(unknown), other).op
        assert _names(op_kinds.forwardable_inputs(mixed)) == [
            (mixed.outputs[0].name, [other.name])]


def _names(pairs):
    return [(out.name, [t.name for t in inputs]) for out, inputs in pairs]


def _scaled_chain_plan(with_v1_cond):
    """`tanh(tanh(tanh(x) * s) * s)` planned with one checkpoint: the model and its plan.
    `with_v1_cond`: a tf.compat.v1 cond elsewhere in the region."""
    import memory_saving_gradients as msg

    graph = tf.Graph()
    with graph.as_default(), control_flow_v1():
        x = tf.compat.v1.placeholder(tf.float32, [8, 16, 16, 32])
        s = tf.compat.v1.placeholder(tf.float32, [32])
        p = tf.compat.v1.placeholder(tf.bool, [])
        w = tf.compat.v1.placeholder(tf.float32, [8, 16, 16, 32])
        c = tf.compat.v1.cond(p, lambda: w * 2.0, lambda: w * 3.0) if with_v1_cond else w * 2.0
        h = tf.tanh(tf.tanh(tf.tanh(x) * s) * s)
        loss = tf.reduce_sum(h) + tf.reduce_sum(c)
        report = msg.checkpoint_plan(loss, [x, s, w], checkpoints=[h.op.inputs[0]])
    return report.model, report.plan


@pytest.mark.parametrize("with_v1_cond", [False, True])
def test_planned_gradients_forward_as_the_rewrite_orders_them(with_v1_cond):
    # The rewrite makes `dy * s` wait for `sum(dy * h)` (product_order), so it
    # writes over `dy`; stock tf.gradients, and the rewrite across
    # tf.compat.v1 control flow (where it orders nothing), do not. Found by a
    # review: with a v1 cond the plan was predicted a 256 KiB buffer under.
    model, plan = _scaled_chain_plan(with_v1_cond)
    as_stock = dataclasses.replace(
        model, forwarded_grads={**model.forwarded_grads, **model.stock_forwarded_grads},
        workspace_forwards={**model.workspace_forwards, **model.stock_workspace_forwards})
    planned, unordered = (timeline.predict(m, plan).peak_bytes for m in (model, as_stock))
    if with_v1_cond:
        assert planned == unordered
    else:
        assert planned < unordered


def _tanh_layer(h):
    return tf.tanh(tf.nn.relu(h) + tf.sigmoid(h))


def _softmax_layer(h):
    # Its gradient's last product takes the intermediate it reads last, not `y`.
    return tf.nn.softmax(tf.nn.relu(h) + 0.5)


def _log1p_layer(h):
    # Its gradient writes `dy * 1 / (1 + x)` over `dy`; `1 + x` is a buffer of its own.
    return tf.math.log1p(tf.nn.relu(h))


def _scaled_layer(h):
    # Stock leaves `dy * s` and `dy * h` unordered: `dy` may be held by the other.
    return tf.tanh(h * tf.reduce_mean(h, axis=0))


def _chain_step(layer, plan):
    """A chain of 8 `layer`s over 1 MiB tensors in a tf.function, its
    gradients by `plan`; returns (predicted, measured) bytes of its
    activations (measured: the peak of the bytes requested, profiled, minus
    the weight gradient; the allocator's own peak counts BFC's chunks, which
    here varied by a buffer from one process to the next). The loss squares
    row sums, so the first gradient is a buffer of the step (a linear loss's
    is folded into a constant by Grappler)."""
    import memory_saving_gradients as msg

    w = tf.Variable(tf.ones(SHAPE[1:]))
    x = tf.constant(np.random.default_rng(0).normal(size=SHAPE).astype(np.float32))

    def loss(x):
        h = x * w
        for _ in range(8):
            h = layer(h)
        return tf.reduce_sum(tf.square(tf.reduce_sum(h, axis=1)))

    @tf.function
    def step(x):
        y = loss(x)
        return msg.gradients(y, [w], checkpoints=plan) if plan else tf.gradients(y, [w])

    holder = {}

    @tf.function
    def predict(x):
        holder["plan"] = msg.checkpoint_plan(loss(x), [w], checkpoints=plan or "memory")
        return tf.constant(0.0)

    predict.get_concrete_function(tf.TensorSpec(SHAPE, tf.float32))
    estimate = holder["plan"].estimate
    predicted = estimate.peak_bytes if plan else estimate.baseline_bytes
    step(x)
    held = []  # the results, alive until the trace stops: returned, not activations
    events = profiled_allocations.allocator_events(lambda: held.append(step(x)))
    return predicted, profiled_allocations.requested_peak(events) - w.numpy().nbytes


@pytest.mark.parametrize("plan, excess", [(None, 0.25 * MIB), ("memory", 1.25 * MIB)])
def test_chain_of_forwarding_kernels_is_predicted_to_the_buffer(measured, plan, excess):
    # Bytes requested, measured: 25 MiB (stock) and 8 ('memory'). Predicted 25
    # and 9 (26 and 10 before kernels writing over what they read last were
    # modelled): the plan's prediction still holds one buffer more (not found).
    predicted, peak = measured["chains"][f"{_tanh_layer.__name__} {plan}"]
    assert -GATE_SCALARS <= predicted - peak <= excess, (predicted / MIB, peak / MIB)


@pytest.mark.parametrize("plan", [None, "memory"])
@pytest.mark.parametrize("layer", [_softmax_layer, _log1p_layer, _scaled_layer])
def test_forwarding_is_never_assumed_where_tensorflow_allocates(measured, layer, plan):
    # Found by a review (each was predicted a buffer under measured): a
    # gradient's result counted twice as forwarded (softmax, log1p), and `dy`
    # assumed free for a product that may run before its sibling (scaled).
    predicted, peak = measured["chains"][f"{layer.__name__} {plan}"]
    assert -GATE_SCALARS <= predicted - peak <= 1.25 * MIB, (predicted / MIB, peak / MIB)


def _measure_all():
    """{"kernels": op type -> peak MiB, "chains": "layer plan" -> (predicted, measured)}."""
    layers = (_tanh_layer, _softmax_layer, _log1p_layer, _scaled_layer)
    return {"kernels": {t: _peak_mib(t) for t in FORWARDING + ["Roll"]},
            "chains": {f"{layer.__name__} {plan}": _chain_step(layer, plan)
                       for layer in layers for plan in (None, "memory")}}


if __name__ == "__main__":  # `module_result` passes the suite's environment on
    print(json.dumps(_measure_all()))
