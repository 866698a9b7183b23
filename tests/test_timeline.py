"""The timeline simulator on hand-built models: no TensorFlow graphs.

Sizes are in units of B bytes per tensor; every expectation below is worked
out by hand from the schedule tf.gradients runs (forward, then each op's
gradient in reverse order, each tensor freed after its last reader).
"""

import dataclasses

import networkx as nx
import pytest

from memory_saving_gradients.core import planning
from memory_saving_gradients.core import timeline
from memory_saving_gradients.core.model import Activation
from memory_saving_gradients.core.model import GraphModel
from memory_saving_gradients.core.model import Loop
from memory_saving_gradients.core.model import WeightSum

B = 100


def chain(n, reads="output", **fields):
    """t00 -> t01 -> ... : one op per tensor; its gradient reads `reads`."""
    names = [f"t{i:02d}" for i in range(n)]
    graph = nx.DiGraph()
    graph.add_nodes_from(names)
    graph.add_edges_from(zip(names, names[1:]))
    tensors = {n: Activation(name=n, op=n, op_type="Op", bytes=B, cost=1,
                             recomputable=True, is_float=True) for n in names}
    preds = {n: tuple(graph.predecessors(n)) for n in names}
    grad_reads = {n: {"output": (n,), "input": preds[n], "nothing": ()}[reads] for n in names}
    model = GraphModel(
        graph=graph, tensors=tensors, order=tuple(names), pinned=frozenset(), ys=(names[-1],),
        op_outputs={n: (n,) for n in names}, num_region_ops=n, grad_reads=grad_reads,
        **fields)
    return model, names


def test_tf_gradients_keeps_what_gradients_read():
    # Outputs read (ReLU-like): all n kept, plus the two gradients in flight.
    model, _ = chain(10, reads="output")
    assert timeline.predict(model).peak_bytes == 12 * B


def test_tf_gradients_frees_what_no_gradient_reads():
    # BiasAdd-like: each output dies after its forward reader; in backprop
    # one gradient in, one out, and the y, which is kept to the end.
    model, _ = chain(10, reads="nothing")
    assert timeline.predict(model).peak_bytes == 3 * B


def test_plan_keeps_checkpoints_and_one_level_at_a_time():
    model, names = chain(16, reads="output")
    plan = planning.make_plan(model, {names[3], names[7], names[11]}, "list")
    est = timeline.predict(model, plan)
    # Checkpoints t03, t07, t11. The tail t12..t15 (4) is alive at the start
    # of backprop with two gradients and the checkpoints the levels read
    # (t03, t07): t11 is recomputed from t07 with its level (the rewrite
    # copies recomputable roots), and no tail gradient reads it. Each level
    # recomputes 4 tensors while the tail and the levels below it are freed.
    assert est.peak_bytes == (4 + 2 + 2) * B
    assert est.baseline_bytes == 18 * B
    assert est.kept_bytes == 3 * B
    assert est.recompute_flops == 12  # t00..t11 rerun once, each cost 1


def test_copies_no_gradient_reads_are_not_run():
    # MatMul-like: the gradient reads the input only, so a level's root copy
    # (whose output nothing reads) is pruned; the copy below it is run.
    model, names = chain(8, reads="input")
    plan = planning.make_plan(model, {names[3]}, "list")
    est = timeline.predict(model, plan)
    assert est.recompute_flops == 3  # t00, t01, t02; never t03


def test_gradient_workspace_counts_at_its_step():
    base, names = chain(6, reads="nothing")
    heavy, _ = chain(6, reads="nothing", workspace={names[2]: 50 * B})
    assert timeline.predict(heavy).peak_bytes == timeline.predict(base).peak_bytes + 50 * B


def test_stock_workspace_prices_tf_gradients_only():
    # An op the rewrite differentiates without scratch (a 1x1 convolution as
    # MatMuls): its stock scratch counts for tf.gradients, not for a plan.
    model, names = chain(6, reads="nothing")
    replaced, _ = chain(6, reads="nothing", stock_workspace={names[4]: 50 * B})
    plan = planning.make_plan(replaced, {names[2]}, "list")
    assert timeline.predict(replaced).baseline_bytes == timeline.predict(model).baseline_bytes + 50 * B
    assert timeline.predict(replaced, plan).peak_bytes == timeline.predict(model, plan).peak_bytes


def test_run_workspace_counts_where_the_op_runs_and_is_recomputed():
    # A transposed convolution's own scratch: at its forward step for both,
    # and again when a plan recomputes it in backprop.
    model, names = chain(6, reads="nothing")
    busy, _ = chain(6, reads="nothing", run_workspace={names[4]: 1000 * B})
    plan = planning.make_plan(busy, {names[2]}, "list")
    assert timeline.predict(busy).baseline_bytes >= 1000 * B
    assert timeline.predict(busy, plan).peak_bytes >= 1000 * B
    assert timeline.predict(model).baseline_bytes < 100 * B


def test_weight_gradients_are_outputs_not_activation_memory():
    model, names = chain(6, reads="output")
    with_weights, _ = chain(6, reads="output",
                            weight_grad_bytes={n: B for n in names})
    # Weight gradients made early in backprop are alive at the peak on both
    # sides of the measurement; activation memory is the peak minus all of them.
    assert timeline.predict(with_weights).peak_bytes <= timeline.predict(model).peak_bytes


def test_activation_peak_leaves_weight_gradients_out_while_they_live():
    model, names = chain(6, reads="output")
    late, _ = chain(6, reads="output", weight_grad_bytes={names[0]: 10 * B})
    whole, activations = timeline.step_peaks(late)
    # The first op's 10 B weight gradient is made last, when the six kept outputs
    # are gone: the step peaks then, and its peak minus the weight gradient is
    # not the activations' peak (reached at the start of backprop).
    assert activations == timeline.predict(model).peak_bytes >= 6 * B
    assert whole == timeline.predict(late).peak_bytes + 10 * B
    assert timeline.predict(late).peak_bytes < activations


def _held_and_summed(top, bottom, sparse):
    """Chains of 6 whose top and bottom ops send `top` and `bottom` bytes to one
    weight of 10 B, the ops of `sparse` as rows: (each part returned as it
    is, the parts added up as a `WeightSum`)."""
    _, names = chain(6)
    parts = (names[5], names[0])
    weights = dict(zip(parts, (top, bottom)))
    summed = WeightSum(weight="table", parts=parts, bytes=10 * B,
                       sparse=frozenset(parts[i] for i in sparse))
    held, _ = chain(6, reads="nothing", weight_grad_bytes=weights)
    added, _ = chain(6, reads="nothing", weight_grad_bytes=weights,
                     weight_sums=dict.fromkeys(parts, summed))
    return held, added


def test_a_weights_parts_are_held_until_added_up_and_only_the_sum_is_returned():
    # A table read at the top (a tied output layer: 10 B, dense) and by a
    # gather at the bottom (2 B of rows). The rows are made dense beside the
    # first part, and AddN writes the sum over them: the whole step peaks at
    # the last gradient one table higher (2 B of gradients in flight), and the
    # output layer's part, not returned, is an activation from its gradient on.
    held, summed = _held_and_summed(10 * B, 2 * B, sparse=[1])
    assert timeline.step_peaks(held) == (14 * B, 3 * B)
    assert timeline.step_peaks(summed) == (24 * B, 14 * B)
    assert timeline.predict(summed).peak_bytes == 14 * B  # less the 10 B returned
    assert (summed.returned_gradient_bytes(), held.returned_gradient_bytes()) == (10 * B, 12 * B)
    # Two gathers: their rows are concatenated, the sum beside its parts.
    held, summed = _held_and_summed(2 * B, 2 * B, sparse=[0, 1])
    assert timeline.step_peaks(held) == (6 * B, 3 * B)
    assert timeline.step_peaks(summed) == (10 * B, 6 * B)
    assert summed.returned_gradient_bytes() == 4 * B
    # Two dense parts: AddN writes the sum over the first made (measured), so
    # the second, not returned, is an activation while it lives.
    held, summed = _held_and_summed(10 * B, 10 * B, sparse=[])
    assert timeline.step_peaks(held) == (22 * B, 3 * B)
    assert timeline.step_peaks(summed) == (22 * B, 12 * B)


def _read_thrice(bottom, reads, as_made=True):
    """A chain of 9 whose ops t08, t04 and `bottom` send 10 B parts to one
    weight through `reads` (the tensors they read it as), and its plan of
    three levels keeping t02 and t05: (model, plan)."""
    _, names = chain(9)
    parts = (names[8], names[4], names[bottom])
    summed = WeightSum(weight="w", parts=parts, bytes=10 * B, sparse=frozenset(),
                       reads=reads, as_made=as_made)
    model, _ = chain(9, reads="nothing", weight_grad_bytes=dict.fromkeys(parts, 10 * B),
                     weight_sums=dict.fromkeys(parts, summed))
    return model, planning.make_plan(model, {names[2], names[5]}, "list")


def test_our_rewrite_adds_a_variables_reads_parts_as_they_are_made():
    # tf.gradients holds the three parts until the last (30 B, plus two
    # gradients in flight); our rewrite adds each to the first as it comes:
    # two parts at most (20 B, plus the level's gradients).
    model, plan = _read_thrice(0, ("a", "b", "c"))
    assert timeline.step_peaks(model) == (32 * B, 22 * B)
    assert timeline.step_peaks(model, plan) == (23 * B, 13 * B)
    held, plan = _read_thrice(0, ("a", "b", "c"), as_made=False)  # a cast read, say
    assert timeline.step_peaks(held, plan) == (32 * B, 22 * B)
    # One read sent two parts in one level (t04 and t03): tf.gradients adds
    # those two in that call, once both are made.
    model, plan = _read_thrice(3, ("a", "b", "c"))
    assert timeline.step_peaks(model, plan) == (23 * B, 13 * B)
    model, plan = _read_thrice(3, ("a", "b", "b"))
    assert timeline.step_peaks(model, plan) == (33 * B, 23 * B)


def test_prediction_is_linear_in_model_size():
    # 20,000 ops in well under the time a quadratic pass would take.
    model, names = chain(20_000, reads="output")
    plan = planning.make_plan(model, set(names[::141]), "list")
    est = timeline.predict(model, plan)
    assert est.peak_bytes < est.baseline_bytes / 20


def test_aliasing_ops_allocate_nothing_and_keep_their_input():
    # t01 is a Reshape of t00: no buffer of its own, and t00's buffer lives
    # as long as t01 is read (here by t01's gradient, to the end of backprop).
    plain, _ = chain(4, reads="output")
    model, names = chain(4, reads="output")
    tensors = dict(model.tensors)
    tensors["t01"] = dataclasses.replace(tensors["t01"], op_type="Reshape")
    reshaped = dataclasses.replace(model, tensors=tensors)
    assert timeline.predict(reshaped).peak_bytes == timeline.predict(plain).peak_bytes - B


def with_loop(model, name, **facts):
    """`model` with op `name` made a While loop of the given `Loop` facts."""
    return dataclasses.replace(model, loops={name: Loop(**facts)})


def test_stock_loop_keeps_every_iteration_until_its_gradient():
    # t02 is a loop of 10 iterations stacking B each: tf.gradients keeps the
    # 10 B of stacks from the forward pass until backprop reaches t02, on top
    # of the 8 outputs and two gradients alive when backprop starts.
    model, names = chain(8, reads="output")
    looped = with_loop(model, "t02", trip_count=10, iteration_bytes=B, state_bytes=B)
    assert timeline.predict(model).peak_bytes == 10 * B
    assert timeline.predict(looped).peak_bytes == 20 * B


def test_values_a_loop_computes_ahead_are_alive_while_it_runs():
    # t02 is a loop of 10 iterations whose body computes B ahead of its
    # recurrence, 4 iterations at a time (Loop.ahead_bytes). Kept nothing,
    # stock's peak is the loop's run: t01, t02 and 4 B ahead (3 B in backprop).
    # A stack of 2 B an iteration uses them up as it grows: no change.
    model, names = chain(8, reads="nothing")
    facts = dict(trip_count=10, state_bytes=B, ahead_bytes=B, parallel_iterations=4)
    assert timeline.predict(with_loop(model, "t02", iteration_bytes=0, **facts)).peak_bytes == 6 * B
    stacked = with_loop(model, "t02", iteration_bytes=2 * B, **facts)
    plain = with_loop(model, "t02", iteration_bytes=2 * B, trip_count=10, state_bytes=B)
    assert timeline.predict(stacked).peak_bytes == timeline.predict(plain).peak_bytes == 23 * B
    # Chunked in 5s, its forward run is the peak: t01, t02, the 2 B of
    # boundaries it saves, and 4 values ahead less a tenth of those each. The
    # rewrite reruns each chunk one iteration at a time: in backprop 1 B ahead
    # beside the boundaries, the y and two gradients (6 B; 9 B with 4 ahead).
    chunked = with_loop(model, "t02", iteration_bytes=0, chunk_size=5, **facts)
    plan = planning.make_plan(chunked, set(), "list")
    assert timeline.predict(chunked, plan).peak_bytes == 2 * B + 2 * B + 4 * (B - 2 * B // 10)


def test_chunked_loop_keeps_boundaries_and_one_chunk():
    # Chunks of 5 of 100 iterations: 20 boundary states (B each) from the
    # forward pass, then one chunk's 5 B of stacks while its gradient runs,
    # instead of 100 B of stacks; the loop is run once more (its cost, 1).
    # The peak is at the loop's gradient: t00..t02, the y, two gradients,
    # the boundaries and one chunk.
    model, names = chain(8, reads="output")
    facts = dict(trip_count=100, iteration_bytes=B, state_bytes=B)
    stock = with_loop(model, "t02", **facts)
    chunked = with_loop(model, "t02", chunk_size=5, **facts)
    plan = planning.make_plan(chunked, set(), "list")
    assert timeline.predict(stock, plan).peak_bytes == (10 + 100) * B
    est = timeline.predict(chunked, plan)
    assert est.peak_bytes == (3 + 1 + 2 + 20 + 5) * B
    assert est.baseline_bytes == (10 + 100) * B  # tf.gradients never chunks
    assert est.recompute_flops == 1


def test_copied_loop_keeps_its_stacks_only_while_its_level_runs():
    # The plan keeps t04 and reruns t00..t04 as a level after the tail
    # (t05..t29) is differentiated; the loop t02 in that level is rerun whole
    # and differentiated by the stock gradient: its 50 B of stacks exist only
    # then, when the tail's outputs are freed. Plain, the tail is the peak
    # (27 B); with the loop, the level: 58 B, not 27 + 50.
    model, names = chain(30, reads="output")
    looped = with_loop(model, "t02", trip_count=50, iteration_bytes=B, state_bytes=B)
    plain = timeline.predict(model, planning.make_plan(model, {names[4]}, "list"))
    est = timeline.predict(looped, planning.make_plan(looped, {names[4]}, "list"))
    assert plain.peak_bytes == 27 * B
    assert est.peak_bytes == 58 * B
    assert est.baseline_bytes == (32 + 50) * B


def test_recomputed_chunked_loop_takes_forward_outputs_or_reruns_a_chain():
    # The plan keeps t04 and recomputes t00..t03, the chunked loop t02 among
    # them (20 boundaries of B, chunks of 5 B). When its forward run saves the
    # boundaries, the copy takes the forward's outputs: boundaries and t02 stay
    # alive through the tail (27 B, see above), 27 + 20 + 1, and the copy is
    # not run again. When a chain of chunks recomputes it in its level, the
    # boundaries exist only there, with the stacks of the chain's last chunk
    # (5 B), which the stock gradient differentiates: made by the chain's run,
    # freed by the loop's gradient, 33 B; the chain is one more run of the loop.
    model, names = chain(30, reads="output")
    facts = dict(trip_count=100, iteration_bytes=B, state_bytes=B, chunk_size=5)
    saved = with_loop(model, "t02", **facts)
    rerun = with_loop(model, "t02", states_saved_when_recomputed=False, **facts)
    saved_est = timeline.predict(saved, planning.make_plan(saved, {names[4]}, "list"))
    rerun_est = timeline.predict(rerun, planning.make_plan(rerun, {names[4]}, "list"))
    assert saved_est.peak_bytes == 48 * B
    assert rerun_est.peak_bytes == 33 * B
    assert rerun_est.recompute_flops == saved_est.recompute_flops + 1


def test_chunked_loop_without_saved_states_reruns_a_chain_in_its_gradient():
    # As in test_chunked_loop_keeps_boundaries_and_one_chunk, but the forward
    # run cannot save the boundaries: its gradient makes them with a chain of
    # chunks first (one more run of the loop), at the same peak step.
    model, names = chain(8, reads="output")
    chunked = with_loop(model, "t02", trip_count=100, iteration_bytes=B, state_bytes=B,
                        chunk_size=5, states_saved_in_place=False)
    est = timeline.predict(chunked, planning.make_plan(chunked, set(), "list"))
    assert est.peak_bytes == (3 + 1 + 2 + 20 + 5) * B
    assert est.recompute_flops == 2


def test_trailing_workspace_runs_beside_the_gradients_below_until_the_next():
    # Where leaf gradients are not ordered (the tail, differentiated where it
    # is), a scratch-free convolution's filter-gradient chain (t05's, then
    # t02's) keeps its scratch through the gradients below it up to and with
    # the next such op's gradient: t03's scratch meets t05's, t01's meets
    # t02's only. In a level, leaf gradients run before backprop leaves their block
    # (tfgraph/leaf_order.py): nothing trails.
    trailing = {"trailing_workspace": {"t05": 1000 * B, "t02": 10 * B}}
    model, names = chain(8, reads="nothing", **trailing)
    tail_only = planning.make_plan(model, set(), "list")
    in_a_level = planning.make_plan(model, {names[6]}, "list")
    meets, _ = chain(8, reads="nothing", workspace={names[3]: 500 * B}, **trailing)
    misses, _ = chain(8, reads="nothing", workspace={names[1]: 500 * B}, **trailing)
    assert timeline.predict(meets, tail_only).peak_bytes >= 1500 * B
    assert 1000 * B <= timeline.predict(misses, tail_only).peak_bytes < 1100 * B
    assert 500 * B <= timeline.predict(meets, in_a_level).peak_bytes < 600 * B
    assert timeline.predict(model).baseline_bytes < 100 * B


def test_a_trailing_chain_directly_above_another_runs_beside_its_gradient():
    # t05's and t04's filter-gradient chains are adjacent: no gradient runs
    # between them. t05's gradient reads t01 (1000 B, no other reader in
    # backprop); its chain goes on reading it beside t04's gradient, whose
    # scratch is 500 B: the two meet. Were t05's chain dropped when t04's
    # starts, t01 would die at t05's gradient and the peak stay near 1000 B.
    model, names = chain(8, reads="nothing",
                         trailing_workspace={"t05": B, "t04": B},
                         workspace={"t04": 500 * B})
    tensors = dict(model.tensors)
    tensors["t01"] = dataclasses.replace(tensors["t01"], bytes=1000 * B)
    grad_reads = {**model.grad_reads, "t05": ("t01",)}
    model = dataclasses.replace(model, tensors=tensors, grad_reads=grad_reads)
    tail_only = planning.make_plan(model, set(), "list")
    assert timeline.predict(model, tail_only).peak_bytes >= 1500 * B


def test_custom_gradient_facts():
    # An IdentityN-like op passes its input's buffer through (shared_buffers).
    model, names = chain(10, reads="output")
    shared, _ = chain(10, reads="output", shared_buffers={names[3]: names[2]})
    assert timeline.predict(shared).baseline_bytes == timeline.predict(model).baseline_bytes - B
    # A gradient that gives t04 no gradient (ungraded): no gradient reaches
    # t00-t04, so tf.gradients builds none of theirs and keeps none of their outputs.
    cut, _ = chain(10, reads="output", ungraded={names[5]: (names[4],)})
    assert timeline.predict(cut).baseline_bytes == 7 * B
    # A gradient part that reads only forward tensors runs with the op and is
    # held to backprop under tf.gradients; in a level it waits for the gradient.
    early, _ = chain(8, reads="nothing", early_workspace={names[1]: 10 * B})
    plan = planning.make_plan(early, {names[4]}, "list")
    assert timeline.predict(early).baseline_bytes >= 10 * B
    assert timeline.predict(early, plan).peak_bytes < 10 * B


@pytest.mark.parametrize("threads", [1, 2])
def test_stock_range_is_predict_without_separate_weight_gradients(threads):
    # A chain of ops whose gradient is one op each (a loop among them): the executor's
    # order (stock_order.parts) is backprop's, so the range is predict's point, loop
    # stacks included.
    model, _ = chain(8, reads="output")
    looped = with_loop(model, "t02", trip_count=10, iteration_bytes=B, state_bytes=B)
    for m in (model, looped):
        stock = timeline.predict(m).baseline_bytes
        assert timeline.stock_peak_range(m, threads) == (stock, stock)


def test_a_gradient_passed_on_takes_no_buffer():
    # BiasAdd-like ops whose input gradient is their output gradient itself
    # (`passed_grads`, as `return grad, grad` of an AddV2 without a reduction):
    # in backprop one gradient buffer goes down the chain, in stock replays and planned ones.
    base, names = chain(10, reads="nothing")
    passing, _ = chain(10, reads="nothing",
                       passed_grads={n: ((p, n),) for p, n in zip(names, names[1:])})
    assert timeline.predict(base).peak_bytes == 3 * B
    assert timeline.predict(passing).peak_bytes == 2 * B
    for model, expected in ((base, 3 * B), (passing, 2 * B)):
        plan = planning.make_plan(model, {names[4]}, "list")
        assert timeline.step_peaks(model, plan)[1] == expected


def _forwarding_chain(n, reads, forward=True, grads=True):
    """`chain` whose ops write their output over their input where it dies there
    (`forwarding`), and whose gradients write theirs over the incoming gradient or
    the op's output (`forwarded_grads`, ReluGrad's candidates)."""
    _, names = chain(n, reads)
    forwarding = {b: ((b, (a,)),) for a, b in zip(names, names[1:])} if forward else {}
    forwarded = ({b: ((a, (("grad", b), ("value", b))),) for a, b in zip(names, names[1:])}
                 if grads else {})
    return chain(n, reads, forwarding=forwarding, forwarded_grads=forwarded)


def test_element_wise_gradients_write_over_the_gradient_they_read_last():
    # ReLU-like (the gradient reads the output): every output is kept, so nothing
    # is forwarded in the forward pass; in backprop each input gradient takes the
    # incoming gradient's buffer: one gradient in flight, not two.
    model, names = _forwarding_chain(10, reads="output")
    assert timeline.predict(chain(10, reads="output")[0]).peak_bytes == 12 * B
    assert timeline.predict(model).peak_bytes == 11 * B
    plan = planning.make_plan(model, {names[3], names[6]}, "list")
    unforwarded = planning.make_plan(chain(10, reads="output")[0], {names[3], names[6]}, "list")
    assert (timeline.predict(model, plan).peak_bytes
            == timeline.predict(chain(10, reads="output")[0], unforwarded).peak_bytes - B)


def test_forward_ops_write_over_an_input_no_one_reads_later():
    # BiasAdd-like (the gradient reads nothing): each output takes its input's
    # buffer, so the forward pass holds one buffer (the y's, kept to the end);
    # backprop one gradient besides it.
    model, names = _forwarding_chain(10, reads="nothing")
    assert timeline.step_peaks(model)[1] == 2 * B
    forward_only, _ = _forwarding_chain(10, reads="nothing", grads=False)
    assert timeline.step_peaks(forward_only)[1] == 3 * B  # two gradients in flight


def test_an_input_read_later_is_not_written_over():
    # Square-like (the gradient reads the input): each input is read again in
    # backprop, so no forward op may take it; only the gradients forward.
    model, _ = _forwarding_chain(10, reads="input", grads=False)
    assert timeline.predict(model).peak_bytes == timeline.predict(
        chain(10, reads="input")[0]).peak_bytes


def test_a_buffer_is_taken_once_per_step_and_only_at_its_size():
    # m = f(a, b), y = g(m): both of m's input gradients may write over m's
    # incoming gradient (as Mul's two products may over `dy`); one of them does.
    names = ["a", "b", "m", "y"]
    graph = nx.DiGraph([("a", "m"), ("b", "m"), ("m", "y")])
    tensors = {n: Activation(name=n, op=n, op_type="Op", bytes=B, cost=1, recomputable=True,
                             is_float=True) for n in names}
    candidates = (("grad", "m"),)
    model = GraphModel(graph=graph, tensors=tensors, order=tuple(names), pinned=frozenset(),
                       ys=("y",), op_outputs={n: (n,) for n in names}, num_region_ops=4,
                       grad_reads={"a": (), "b": (), "m": ("a", "b"), "y": ()},
                       forwarded_grads={"m": (("a", candidates), ("b", candidates))})

    def unforwarded(m):
        return dataclasses.replace(m, forwarded_grads={})

    assert timeline.predict(unforwarded(model)).peak_bytes - timeline.predict(
        model).peak_bytes == B
    # a's gradient is twice the incoming gradient's size: it cannot take that buffer.
    larger = dataclasses.replace(
        model, tensors={**tensors, "a": dataclasses.replace(tensors["a"], bytes=2 * B)},
        forwarded_grads={"m": (("a", candidates),)})
    assert timeline.predict(larger).peak_bytes == timeline.predict(
        unforwarded(larger)).peak_bytes


def _reshaped_pair_model(**fields):
    """a -> r (a Reshape: a's buffer) ; m = f(a, r) ; y = g(m). Nothing read by gradients."""
    names = ["a", "r", "m", "y"]
    graph = nx.DiGraph([("a", "r"), ("a", "m"), ("r", "m"), ("m", "y")])
    tensors = {n: Activation(name=n, op=n, op_type="Reshape" if n == "r" else "Op", bytes=B,
                             cost=1, recomputable=True, is_float=True) for n in names}
    return GraphModel(graph=graph, tensors=tensors, order=tuple(names), pinned=frozenset(),
                      ys=("y",), op_outputs={n: (n,) for n in names}, num_region_ops=4,
                      grad_reads={n: () for n in names}, **fields)


def test_a_buffer_read_twice_through_an_alias_is_not_written_over():
    # m reads a's buffer twice (as `a + reshape(a)`): held twice, TensorFlow
    # gives m a buffer of its own; the same m reading a once (through r only)
    # would take it.
    twice = _reshaped_pair_model(forwarding={"m": (("m", ("a", "r")),)})
    plain = _reshaped_pair_model()
    assert timeline.step_peaks(twice)[1] == timeline.step_peaks(plain)[1]
    replay = timeline._Replay(twice, stock=True)  # pylint: disable=protected-access
    replay.run(())
    assert ("fwd", "m") not in replay.alias


def test_the_buffer_a_y_shares_lives_to_the_end():
    # y is a Reshape of its input: that input's buffer is returned with it.
    model, names = chain(4, reads="nothing")
    model = dataclasses.replace(model, tensors={
        **model.tensors, names[-1]: dataclasses.replace(model.tensors[names[-1]],
                                                        op_type="Reshape")})
    replay = timeline._Replay(model, stock=True)  # pylint: disable=protected-access
    replay.run(())
    assert replay.last_use[("fwd", names[-2])] == float("inf")


def test_a_weight_gradient_run_first_frees_its_input_before_the_input_gradient():
    # Convolution-like ops, whose gradient reads their input (for the weight
    # gradient): run first, the weight gradient frees that input before the
    # input gradient is allocated (`GraphModel.weights_first`).
    names = chain(8)[1]
    fields = dict(reads="input", weight_grad_bytes={n: 1 for n in names})
    unordered, _ = chain(8, **fields)
    ordered, _ = chain(8, weights_first=frozenset(names), **fields)
    plan = planning.make_plan(unordered, {names[3]}, "list")
    before, after = (timeline.predict(m, plan) for m in (unordered, ordered))
    assert after.peak_bytes == before.peak_bytes - B
    assert after.baseline_bytes == before.baseline_bytes  # stock leaves the two unordered


def test_the_input_gradient_takes_its_scratch_beside_an_input_still_read():
    # Found by a review: with the gradient's scratch counted at the weight
    # gradient's step only, a convolution whose input outlives its gradient
    # (a ReLU's gradient reads it next) was predicted the input gradient under.
    unordered, names = chain(8, reads="input", weight_grad_bytes={"t05": 1},
                             workspace={"t05": 10 * B})
    reads = {**unordered.grad_reads, "t04": ("t03", "t04")}  # t04's gradient reads t04 too
    unordered = dataclasses.replace(unordered, grad_reads=reads)
    ordered = dataclasses.replace(unordered, weights_first=frozenset({"t05"}))
    plan = planning.make_plan(unordered, {names[2]}, "list")
    # At t05's gradient: t04, its output's gradient, the input gradient and the scratch.
    assert timeline.predict(ordered, plan).peak_bytes == timeline.predict(unordered, plan).peak_bytes
