"""Gradients that read the forward tensors they closed over (tf.custom_gradient).

A `tf.custom_gradient` function's gradient is a Python closure over the
tensors of the call that made it. `tf.nn.silu` (Keras' swish, EfficientNet's
activation) is one: its gradient recomputes the sigmoid from the *original*
features, and computes `beta * features` outside its wait for `dy`. Before:
a recomputed copy's gradient read the original input (kept from the forward
pass to backprop), kept tensors' products ran in the forward pass, and the
model took the op's gradient to read every input and output. Now the rewrite
points such reads at the level's copies and stubs and makes them wait for the
gradient (tfgraph/captured_reads.py), and the probe sees the closure's reads
(tfgraph/gradient_reads.py).

Peaks are the allocation records of a traced Session run (bytes requested),
with 250,000-float tensors: 1 MB each.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from tests.harness import module_result
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import gradient_reads
from memory_saving_gradients.tfgraph import identity_folding
from tests.harness import one_thread_session_config

UNIT = 250_000


def _silu_chain(depth):
    """x -> (x * w_i -> silu) * depth -> sum: every silu a tf.custom_gradient.
    Returns (x, weights, sum, every fourth silu output)."""
    x = tf.compat.v1.placeholder(tf.float32, [UNIT])
    weights = [tf.Variable(1.0 + 0.01 * i, name=f"w{i}") for i in range(depth)]
    node, marks = x, []
    for i, w in enumerate(weights):
        node = tf.nn.silu(node * w)
        if i % 4 == 3:
            marks.append(node)
    return x, weights, tf.reduce_sum(node), marks


@pytest.fixture(scope="module")
def peaks():
    """(estimate of 'memory', stock peak, our peak), measured in one Session."""
    graph = tf.Graph()
    with graph.as_default():
        x, weights, y, marks = _silu_chain(depth=16)
        stock = tf.gradients(y, weights)
        # A fixed plan: "memory"'s choice among equal-peak plans varies between
        # processes, and with it the measured peak.
        plan = msg.checkpoint_plan(y, weights, marks)
        ours = msg.gradients(y, weights, checkpoints=marks)
        feed = {x: np.random.RandomState(0).randn(UNIT).astype(np.float32)}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            stock_peak, stock_val = msg.session_peak_bytes(sess, stock, feed)
        # Ours with one inter-op thread: the order the timeline replays (with
        # several, the executor's order moved our peak between 13 and 16.6 MB
        # from run to run). Stock's one-thread peak is lower (36-41 MB: its
        # order frees the forward tensors sooner than the timeline's replay).
        config = one_thread_session_config()
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            ours_peak, ours_val = msg.session_peak_bytes(sess, ours, feed)
    np.testing.assert_allclose(ours_val, stock_val, rtol=1e-5)
    return plan.estimate, stock_peak, ours_peak


def test_recomputed_custom_gradients_read_the_copies(peaks):
    _, stock, ours = peaks
    # Before: 41-43 MB of stock's 49 (each copy's gradient read its original
    # input, and kept inputs' products ran in the forward pass). After: 13-16.7
    # MB; stock's own peak moves with the executor's order (36-49 MB).
    assert ours < 20 * 4 * UNIT and ours < 0.5 * stock, (ours, stock)


@pytest.mark.xfail(strict=False, reason=(
    "predicted 14.0 MB; measured 13.6-16.7 in the records (one inter-op thread, same "
    "plan: BFC's chunks, up to twice a request) and 12.0-15.0 in bytes requested"))
def test_plan_of_custom_gradients_predicted_within_15_percent(peaks):
    estimate, _, ours = peaks
    # Before: 15 MB predicted vs 43 measured.
    assert estimate.peak_bytes == pytest.approx(ours, rel=0.15), (estimate.peak_bytes, ours)


def test_stock_custom_gradients_predicted_within_15_percent(peaks):
    estimate, stock, _ = peaks
    # Before: 83 MB predicted vs 48-49 measured (the probe could not build the
    # closure's gradient on a scratch graph and took it to read everything).
    assert estimate.baseline_bytes == pytest.approx(stock, rel=0.15), (estimate, stock)


def test_the_probe_sees_what_the_closure_reads():
    graph = tf.Graph()
    with graph.as_default():
        _silu_chain(depth=1)
        identity_n = next(op for op in graph.get_operations() if op.type == "IdentityN")
        reads = gradient_reads.gradient_reads(identity_n)
    # IdentityN(result, features, beta): the gradient reads the features (and
    # beta), not the result nor any output; the result gets no gradient.
    assert 1 in reads.inputs and 0 not in reads.inputs and reads.outputs == ()
    assert reads.ungraded == (0,)


def test_gradient_parts_reading_forward_tensors_and_constants_wait():
    """A custom gradient's `x * c` (an outside forward tensor times a constant
    its gradient made) depends on no output gradient: it ran in the forward
    pass and was held until backprop (measured 42 MB, predicted 24). Now it
    waits for the gradient like the parts that read forward tensors alone."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [UNIT])  # 2 MB

        def scaled_sine(scale):
            @tf.custom_gradient
            def f(h):
                return tf.sin(h), lambda dy: dy * tf.cos(h) + dy * (x * scale)
            return f

        weights = [tf.Variable(tf.constant(1.0 + 0.01 * i, tf.float64)) for i in range(12)]
        node, marks = x, []
        for i, w in enumerate(weights):
            # Distinct scales, so that common-subexpression elimination keeps them apart.
            node = scaled_sine(0.5 + i)(node * w)
            if i % 4 == 3:
                marks.append(node)
        y = tf.reduce_sum(node)
        stock = tf.gradients(y, weights)
        ours = msg.gradients(y, weights, checkpoints=marks)
        estimate = msg.checkpoint_plan(y, weights, marks).estimate
        feed = {x: np.random.RandomState(0).randn(UNIT)}
        config = one_thread_session_config()
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _, stock_val = msg.session_peak_bytes(sess, stock, feed)
            ours_peak, ours_val = msg.session_peak_bytes(sess, ours, feed)
    np.testing.assert_allclose(ours_val, stock_val, rtol=1e-9)
    # After: 26 MB measured, once 31.4 (5.4 MB that came and went, as above).
    assert ours_peak < 1.5 * estimate.peak_bytes, (ours_peak, estimate.peak_bytes)


@pytest.mark.parametrize("rows", ["known", "unknown"])
def test_stock_silu_in_a_function_predicted_without_its_folded_product(rows):
    # In a tf.function Grappler folds silu's early `beta * features` (beta = 1)
    # into an Identity: before, the 16 MB counted for it put the prediction at
    # 51 MB against 33 measured (it is kept in a Session: the test above). With
    # the rows unknown it was still counted until session 50: 49 MB against 34.
    peaks = module_result("tests.silu_stock_peak", "default")[rows]
    assert peaks["measured_mb"] < 40, peaks  # the fold happens
    assert peaks["predicted_mb"] == pytest.approx(peaks["measured_mb"], rel=0.15), peaks


def test_stock_silu_beside_an_in_place_op_predicted_with_its_product():
    """Beside an op writing its input in place Grappler makes `beta * features`
    a Snapshot, a copy, not an Identity: predicted as folded (35 MB) before
    session 51, measured 48. How much of it is held depends on the schedule:
    the second `beta * features` of silu's gradient waits for nothing, and the
    executor runs it early (all 16 held: 48 MB) or late (35-42, seen in CI and
    with one inter-op thread). So the prediction counts the copies, and
    no schedule measured exceeds it."""
    peaks = module_result("tests.silu_stock_peak", "default")
    folded, in_place = peaks["known"], peaks["in_place"]
    assert in_place["predicted_mb"] > folded["predicted_mb"] + 12, peaks  # the copies
    assert in_place["measured_mb"] < 1.15 * in_place["predicted_mb"], peaks


def test_no_fold_is_assumed_with_grappler_switched_off():
    """With the meta optimizer disabled nothing is folded: a review measured the
    16-silu chain at 48-49 MB there, predicted at 34 as if `x * 1` were folded."""
    function_graph = tf.function(lambda: tf.constant(1.0)).get_concrete_function().graph
    assert compat.folds_constants(function_graph)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        assert not compat.folds_constants(function_graph)
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})
    assert compat.folds_constants(function_graph)


def test_products_by_one_are_copies_beside_an_op_writing_in_place():
    """Grappler makes `x * 1` a Snapshot, not an Identity, where an op of the
    step writes an input in place, in the step's graph, a nested function or a
    cond's branch, whichever of them `x * 1` is in (a review's find: nested
    ones were missed, measured 48 MB against 34 predicted); a variable's
    assignment is no such op."""
    variable = tf.Variable(1.0)
    graphs = {}

    def in_place(small):
        return tf.raw_ops.InplaceAdd(x=small, i=[0], v=tf.ones([1, 3]))

    nested = tf.function(in_place)

    def in_a_branch(small):
        graphs["branch"] = tf.compat.v1.get_default_graph()
        return small * 1.0

    def graph_of(body):
        return tf.function(body).get_concrete_function().graph

    def small():
        return tf.zeros([2, 3]) + variable

    assert identity_folding.folds_to_identities(graph_of(lambda: variable.assign_add(1.0)))
    assert not identity_folding.folds_to_identities(graph_of(lambda: in_place(small())))
    assert not identity_folding.folds_to_identities(graph_of(lambda: nested(small())))
    assert not identity_folding.folds_to_identities(graph_of(
        lambda: tf.cond(variable > 0, lambda: in_place(small()), small)))
    graph_of(lambda: (in_place(small()), tf.cond(variable > 0, lambda: in_a_branch(small()),
                                                   small)))
    assert not identity_folding.folds_to_identities(graphs["branch"])


# The features' gradient alone, as a model's reading asks for it (the op is an
# IdentityN of silu's result, its features and beta, a constant).
FEATURES_ONLY = (True, True, False)


@pytest.mark.parametrize("rows", [32, None])
def test_a_swish_gradient_holds_no_buffer_for_its_product_by_one(rows):
    """In a tf.function silu's gradient computes `beta * features` (beta = 1),
    which Grappler folds into an Identity, the rows known or not: nothing of
    the features' gradient is made early, and its scratch while it runs is
    one buffer, its sigmoid, beside the result (without the fold: one early
    buffer, two of scratch; EfficientNetB0's recomputed swish gradients were
    predicted 27 MiB above measured at 96 px and batch 32 before session 50).
    With beta's gradient too, `square(features)` is made early and held beside
    the sigmoid (before session 51 the probe priced that at one buffer: the
    closure's captured features counted as a buffer of its own, which a wrong
    write over a shared buffer cancelled)."""
    found = {}

    @tf.function(input_signature=[tf.TensorSpec([rows, 1000])])
    def swish(x):
        found["op"] = tf.nn.silu(x * 2.0).op
        return found["op"].outputs[0]

    swish.get_concrete_function()
    buffer = 32 * 1000 * 4  # the planner counts unknown rows as 32
    reads = gradient_reads.gradient_reads(found["op"], FEATURES_ONLY, folds=True)
    assert reads.early_bytes == 0
    assert reads.scratch_bytes == pytest.approx(buffer, rel=1e-3)
    unfolded = gradient_reads.gradient_reads(found["op"], FEATURES_ONLY, folds=False)
    assert unfolded.early_bytes == buffer
    assert unfolded.scratch_bytes == pytest.approx(2 * buffer, rel=1e-3)
    with_beta = gradient_reads.gradient_reads(found["op"], folds=True)
    assert with_beta.early_bytes == buffer
    assert with_beta.scratch_bytes == pytest.approx(2 * buffer, rel=1e-3)
    # The result may be written over an intermediate, which the scratch counts as
    # the result: not over the incoming gradient alone. With the rows unknown the
    # closure's tensors were of unknown batch beside stand-ins of 32 rows, and
    # before session 50 only the incoming gradient matched the result's shape.
    assert reads.forwards == ()


@pytest.mark.parametrize("rows", [32, None])
def test_a_custom_gradient_closure_is_sized_as_its_call_is(rows):
    """A tf.custom_gradient's closure holds the call's own tensors, which the
    probe captures: with the batch unknown and the features reshaped into
    4 rows an image, they are sized as the planner sizes the call (128 rows),
    not at 32 rows from their static shape (before session 51: a quarter of
    a buffer each, a review's find)."""
    found = {}

    @tf.function(input_signature=[tf.TensorSpec([rows, 4, 1000])])
    def swish(x):
        found["op"] = tf.nn.silu(tf.reshape(x * 2.0, [-1, 1000])).op
        return found["op"].outputs[0]

    swish.get_concrete_function()
    buffer = 4 * 32 * 1000 * 4
    reads = gradient_reads.gradient_reads(found["op"], FEATURES_ONLY, folds=True)
    assert reads.scratch_bytes == pytest.approx(buffer, rel=1e-3)
    assert reads.forwards == ()
    with_beta = gradient_reads.gradient_reads(found["op"], folds=True)
    assert with_beta.early_bytes == buffer  # square(features)
    assert with_beta.scratch_bytes == pytest.approx(2 * buffer, rel=1e-3)


def test_a_closure_sized_into_a_conflict_is_probed_unsized():
    """Where the sizes assumed for a closure's captured tensors conflict with
    the call's own (known) shapes, the probe is built again with them left
    unknown, as for any op, rather than taken to read everything (a review's
    find: `captured` was lost and the gradient was called nonlinear)."""
    found = {}

    @tf.custom_gradient
    def scaled(x):
        # Rows of 10 statically unknown: the planner assumes 32 for them.
        scale = tf.reshape(tf.boolean_mask(x, x > -1e9), [8, -1])
        return x * scale, lambda dy: dy * scale

    @tf.function(input_signature=[tf.TensorSpec([8, 10])])
    def step(x):
        found["op"] = scaled(x).op
        return found["op"].outputs[0]

    step.get_concrete_function()
    reads = gradient_reads.gradient_reads(found["op"])
    assert reads.linear and len(reads.captured) == 1, reads
    assert reads.inputs == () and reads.outputs == (), reads
