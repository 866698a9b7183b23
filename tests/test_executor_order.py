"""The executor's ready-queue simulation (core/executor_order.py) and stock backprop's
parts (core/stock_order.py) on toy graphs: no TensorFlow."""

import dataclasses

import networkx as nx

from memory_saving_gradients.core import executor_order, stock_order, timeline
from memory_saving_gradients.core.model import Activation, GraphModel


def _chain_of_layers(layers):
    """A plain chain's backprop as TensorFlow lists it: each layer's gradient `R<i>` makes
    ready its bias gradient `B<i>`, weight gradient `W<i>` and data gradient `D<i>`
    (in that out-edge order); `D<i>` feeds the next layer's `R`."""
    successors, cost = {}, {}
    for i in reversed(range(layers)):
        successors[f"R{i}"] = [f"B{i}", f"W{i}", f"D{i}"]
        if i:
            successors[f"D{i}"] = [f"R{i - 1}"]
        cost.update({f"R{i}": 1, f"B{i}": 1, f"W{i}": 4, f"D{i}": 4})
    return successors, cost


def test_one_thread_defers_what_it_hands_over_until_the_chain_stops():
    # Measured (TF 2.21, one inter-op thread, 4 Dense layers with bias, no residual):
    # ReluGrad and data MatMul of each layer down the chain, then MatMul_1 and
    # BiasAddGrad of layer 0, of layer 1, ... (last handed over, first run).
    successors, cost = _chain_of_layers(4)
    runs = executor_order.simulate(successors, cost, {}, threads=1)
    assert [r.op for r in runs] == [
        "R3", "D3", "R2", "D2", "R1", "D1", "R0", "D0",
        "W0", "B0", "W1", "B1", "W2", "B2", "W3", "B3"]
    assert {r.thread for r in runs} == {0}
    assert all(a.finish <= b.start for a, b in zip(runs, runs[1:]))  # one at a time


def test_the_last_expensive_op_of_a_list_runs_first():
    # The same chain with the weight gradient listed last: it runs inline, and the
    # data gradient (handed over) runs right after it, before the chain goes on.
    successors, cost = _chain_of_layers(2)
    for i in range(2):
        successors[f"R{i}"] = [f"B{i}", f"D{i}", f"W{i}"]
    order = [r.op for r in executor_order.simulate(successors, cost, {}, threads=1)]
    assert order == ["R1", "W1", "D1", "R0", "W0", "D0", "B0", "B1"]


def test_cheap_ops_run_inline_first_in_first_out():
    successors = {"a": ["c1", "x", "c2"], "c1": [], "c2": [], "x": []}
    cost = {"a": 1, "c1": 1, "c2": 1, "x": 1}
    order = [r.op for r in executor_order.simulate(
        successors, cost, {"c1": False, "c2": False}, threads=1)]
    # The expensive op is handed over (the inline queue was not empty): cheap ones first.
    assert order == ["a", "c1", "c2", "x"]


def test_two_threads_run_what_is_handed_over_beside_the_chain():
    successors, cost = _chain_of_layers(3)
    runs = executor_order.simulate(successors, cost, {}, threads=2)
    by_op = {r.op: r for r in runs}
    assert {r.thread for r in runs} == {0, 1}
    # The weight gradient of the top layer runs while its data gradient does.
    assert by_op["W2"].start < by_op["D2"].finish and by_op["D2"].start < by_op["W2"].finish
    # Nothing waits for the end: the last layer's bias gradient starts before the chain ends.
    assert by_op["B2"].start < by_op["D0"].finish
    # Deterministic.
    assert runs == executor_order.simulate(successors, cost, {}, threads=2)


def _dense_chain(layers, width_bytes=1 << 20, layer_type="MatMul"):
    """x -> (`layer_type` -> BiasAdd -> Relu) * layers -> loss, as a GraphModel."""
    graph, tensors, outputs, order, reads = nx.DiGraph(), {}, {}, [], {}

    def add(name, op_type, inputs, size=width_bytes):
        tensors[name + ":0"] = Activation(name + ":0", name, op_type, size, size, True, True)
        outputs[name] = (name + ":0",)
        # What TensorFlow's gradients read: a MatMul (or a convolution) its input,
        # a Relu its output.
        reads[name] = {"MatMul": tuple(inputs), "Conv2D": tuple(inputs),
                       "Relu": (name + ":0",)}.get(op_type, ())
        graph.add_node(name + ":0")
        for i in inputs:
            graph.add_edge(i, name + ":0")
        order.append(name + ":0")
        return name + ":0"

    h = add("x", "Placeholder", ())
    weights = {}
    for i in range(layers):
        m = add(f"mm{i}", layer_type, [h])
        b = add(f"b{i}", "BiasAdd", [m])
        h = add(f"r{i}", "Relu", [b])
        weights[f"mm{i}"], weights[f"b{i}"] = 1024, 16
    loss = add("loss", "Sum", [h], size=4)
    return GraphModel(graph=graph, tensors=tensors, order=tuple(order), pinned=frozenset(),
                      ys=(loss,), op_outputs=outputs, weight_grad_bytes=weights,
                      grad_reads=reads)


def test_stock_parts_order_of_a_dense_chain():
    model = _dense_chain(3)
    data_first = stock_order.parts(model, threads=1, data_last=True)
    # Every weight gradient waits for the end of the chain of data gradients.
    ends = data_first.index(("mm0", stock_order.DATA))
    assert all(data_first.index((f"mm{i}", stock_order.WEIGHTS)) > ends for i in range(3))
    weights_first = stock_order.parts(model, threads=1, data_last=False)
    for i in range(3):
        assert (weights_first.index((f"mm{i}", stock_order.WEIGHTS))
                < weights_first.index((f"mm{i}", stock_order.DATA)))
    assert sorted(data_first) == sorted(weights_first)


def test_the_gradient_of_a_y_is_made_ready_like_any_other():
    # A y that is a convolution's output: its filter gradient waits like the others
    # (the ys' incoming gradients come from ops of their own, not from the caller).
    model = dataclasses.replace(_dense_chain(3, layer_type="Conv2D"), ys=("mm2:0",))
    order = stock_order.parts(model, threads=1, data_last=True)
    assert order.index(("mm2", stock_order.WEIGHTS)) > order.index(("mm0", stock_order.DATA))
    parts = (stock_order.DATA, stock_order.WEIGHTS, stock_order.WHOLE)
    assert len(set(order)) == len(order) and all(part in parts for _, part in order), order


def test_deferred_weight_gradients_hold_their_reads():
    # Deferred to the end, each MatMul's weight gradient keeps its input (the previous
    # layer's output) and its output gradient: at the end of the chain two tensors a
    # layer are alive (12 MiB; stock's peak is 9 MiB, at the end of the forward pass).
    # Run at once, stock's one-op-at-a-time replay is the same as before.
    model = _dense_chain(6)
    mib = 1 << 20
    stock = timeline.predict(model).baseline_bytes
    weights_first = timeline._Replay(  # pylint: disable=protected-access
        model, stock=True, stock_parts=stock_order.parts(model, 1, data_last=False)).run(())
    data_first = timeline._Replay(  # pylint: disable=protected-access
        model, stock=True, stock_parts=stock_order.parts(model, 1, data_last=True)).run(())
    assert abs(weights_first - stock) <= 2 * mib, (weights_first, stock)
    assert data_first >= 12 * mib > stock, (data_first, stock)


def test_deferred_weight_gradients_replay_stock_in_the_executor_order():
    # With one inter-op thread TensorFlow's own kernels' convolution filter gradients
    # wait (GraphModel.deferred_weight_gradient_types, stock_order.WEIGHTS_LISTED_FIRST),
    # holding their reads; a MatMul's run at once. The predicted stock step
    # (timeline.step_peaks) follows; what plans are compared with (predict) does not.
    def activation_peak(model, deferred_types):
        return timeline.step_peaks(dataclasses.replace(
            model, deferred_weight_gradient_types=frozenset(deferred_types)))[1]

    mib = 1 << 20
    convolutions = _dense_chain(6, layer_type="Conv2D")
    several = activation_peak(convolutions, ())
    one = activation_peak(convolutions, stock_order.WEIGHTS_LISTED_FIRST)
    assert one >= several + 5 * mib, (one, several)
    one_thread = dataclasses.replace(
        convolutions, deferred_weight_gradient_types=stock_order.WEIGHTS_LISTED_FIRST)
    assert (timeline.predict(one_thread).baseline_bytes
            == timeline.predict(convolutions).baseline_bytes)
    dense = _dense_chain(6)
    one = activation_peak(dense, stock_order.WEIGHTS_LISTED_FIRST)
    assert one == activation_peak(dense, ()) < activation_peak(dense, {"MatMul"}) - 5 * mib, one
