"""Where the predicted activation peak falls and what holds it: hand-built
chains (no TensorFlow graphs), then one traced step through `checkpoint_plan`."""

import dataclasses

import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.core import peak_breakdown
from memory_saving_gradients.core import planning
from memory_saving_gradients.core import timeline
from test_timeline import B, _forwarding_chain, chain, with_loop


def _sums_to_the_peak(breakdown, model, plan=None):
    assert breakdown.bytes == timeline.activation_peak(model, plan)
    assert sum(b.bytes for b in breakdown.buffers) == breakdown.bytes
    assert [b.bytes for b in breakdown.buffers] == sorted(
        (b.bytes for b in breakdown.buffers), reverse=True)


def test_stock_peaks_holding_every_output_its_gradients_read():
    model, _ = chain(10, reads="output")
    breakdown = peak_breakdown.peak_breakdown(model)
    _sums_to_the_peak(breakdown, model)
    # All ten outputs, then the gradient in and the one out, early in backprop.
    assert breakdown.bytes_by_kind() == {"kept from the forward pass": 10 * B, "gradient": 2 * B}
    assert breakdown.running.startswith("differentiating ")
    assert breakdown.running.endswith("(backprop)")
    assert breakdown.near == ()  # the forward pass ends at 10 of 12


def test_a_plan_peaking_alike_in_two_phases_names_both():
    model, names = chain(16, reads="output")
    plan = planning.make_plan(model, {names[3], names[7], names[11]}, "list")
    breakdown = peak_breakdown.peak_breakdown(model, plan)
    _sums_to_the_peak(breakdown, model, plan)
    # The tail (t12..t15, two gradients, the checkpoints t03 and t07 the
    # levels read) and level 2 (t08..t11 recomputed beside t03 and t07).
    assert breakdown.bytes == 8 * B
    assert breakdown.running == "differentiating t14 (tail)"
    assert breakdown.near == ((8 * B, "differentiating t11 (level 2)"),)
    assert {b.name for b in breakdown.buffers if b.kind == "kept from the forward pass"} == {
        "t03", "t07", "t12", "t13", "t14", "t15"}


def test_a_large_first_layer_sets_the_peak_where_it_is_recomputed():
    model, names = chain(16, reads="output")
    tensors = {**model.tensors, **{n: dataclasses.replace(model.tensors[n], bytes=20 * B)
                                   for n in names[:2]}}
    model = dataclasses.replace(model, tensors=tensors)
    plan = planning.make_plan(model, {names[3], names[7], names[11]}, "list")
    breakdown = peak_breakdown.peak_breakdown(model, plan)
    _sums_to_the_peak(breakdown, model, plan)
    assert breakdown.running == "differentiating t01 (level 0)"
    largest = breakdown.buffers[:2]
    assert [(b.kind, b.name, b.bytes) for b in largest] == [
        ("recomputed", "t00 (level 0)", 20 * B), ("recomputed", "t01 (level 0)", 20 * B)]
    assert "while differentiating t01 (level 0)" in breakdown.describe()


def test_a_buffer_a_later_result_wrote_over_is_named_by_that_result():
    # BiasAdd-like ops write their output over their input: t00's buffer holds
    # t09, the y (a ReLU over its convolution's output is named by the ReLU).
    model, _ = _forwarding_chain(10, reads="nothing")
    breakdown = peak_breakdown.peak_breakdown(model)
    _sums_to_the_peak(breakdown, model)
    assert [(b.kind, b.name) for b in breakdown.buffers] == [
        ("kept from the forward pass", "t09"), ("gradient", "of t08")]


def test_a_chunked_loop_plan_reports_its_states_and_reruns_as_the_loop_s():
    model, _ = chain(8, reads="output")
    model = with_loop(model, "t02", chunk_size=5, trip_count=100, iteration_bytes=B,
                      state_bytes=B)
    plan = planning.make_plan(model, set(), "list")  # no level: the loop in chunks
    breakdown = peak_breakdown.peak_breakdown(model, plan)
    _sums_to_the_peak(breakdown, model, plan)
    assert breakdown.running == "differentiating t02 (tail)"
    # 20 chunk boundaries of one state each; the chunk rerun's 5 iterations.
    assert breakdown.bytes_by_kind()["loop state"] == 20 * B
    assert breakdown.bytes_by_kind()["loop scratch"] == 5 * B
    assert "kernel scratch" not in breakdown.bytes_by_kind()


def test_checkpoint_plan_prints_where_the_plan_and_tf_gradients_peak():
    layers = [tf.keras.layers.Dense(256, activation="tanh") for _ in range(8)]

    made = []

    def step(x):
        h = x
        for layer in layers:
            h = layer(h)
        made.append(msg.checkpoint_plan(tf.reduce_sum(h), [w for l in layers for w in l.weights]))
        return h

    tf.function(step).get_concrete_function(tf.TensorSpec((512, 256)))
    report = made[0]
    assert report.peak.bytes == timeline.activation_peak(report.model, report.plan)
    assert report.stock_peak.bytes == timeline.activation_peak(report.model)
    assert report.peak.bytes < report.stock_peak.bytes
    text = str(report)
    assert f"while they live): {report.peak.describe()}" in text
    assert "tf.gradients' peak of activations alone" in text
    assert text.count(report.stock_peak.describe()) == 1

