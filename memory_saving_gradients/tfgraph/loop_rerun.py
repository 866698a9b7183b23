"""Rerunning a v2 While loop, or a chunk of it, during backprop (loop_chunks.py).

A rerun is a new While op like the loop (its attributes as while_v2 built it,
functions of its own) that reads given inputs; it is differentiated by the
stock gradient once the gradient from after it has arrived.
"""

import contextlib
import functools
import threading
import weakref
from typing import Iterator

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import gradient_linearity
from memory_saving_gradients.tfgraph import loop_recording
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import gradient_waits


def differentiate_rerun(graph, inputs, grads, rerun, after=()):
    """Gradients of a loop's `inputs`, from `rerun(inputs)` (its outputs again),
    given `grads` of those outputs: [None, None] + one per carried input.

    The rerun waits for the incoming gradient, and for the gradients `after`
    (`in_turn`), through data (one input plus a zero computed from them),
    since XLA drops control edges: run early, every chunk's intermediates
    would be alive at once. `inputs` may be a callable making them (then made
    after the gradient arrived too).
    """
    grads = _without_filled_zeros(grads)
    wanted = [i for i, g in enumerate(grads) if g is not None]
    arrived = [g for g in [grads[i] for i in wanted] + list(after)
               if gradient_waits.is_numeric(gradient_waits.gradient_values(g).dtype)]
    with graph.control_dependencies([gradient_waits.gradient_values(g).op for g in arrived]):
        inputs = list(inputs() if callable(inputs) else inputs)
        inputs = inputs[:2] + [tf.identity(t) for t in inputs[2:]]
    tied = _first_float(inputs)
    if arrived and tied is not None:
        inputs[tied] = gradient_waits.wait_for_gate(inputs[tied], gradient_waits.gate(arrived))
    outputs = rerun(inputs)
    if compat.in_xla_context(graph) and tied is not None:
        grads = _unfoldable(grads, inputs[tied])
    partials = compat.stock_gradients([outputs[i] for i in wanted], inputs[2:],
                                [grads[i] for i in wanted])
    return [None, None] + list(partials)


def _without_filled_zeros(grads):
    """`grads` with the zeros tf.gradients fills in for the loop's outputs that
    get no gradient (a `ZerosLike` of the output, or a `Fill` of zeros where
    its shape is known; `gradient_linearity.is_zero_maker`) as None, where
    another gradient arrived: the rerun's own gradient adds the same nothing.

    Those zeros read the loop's outputs, not the gradient, so the executor made
    them as soon as the loop ran, in the forward pass for a loop differentiated
    where it is, and held them until its gradient: a TensorList zero the size
    of the whole list (4 MiB per layer for an LSTM's input sequence list at
    batch 512, 16 steps, 128 features). Left unused, they are not run.
    """
    def filled(g):
        return g is not None and gradient_linearity.is_zero_maker(
            gradient_waits.gradient_values(g).op)
    if all(g is None or filled(g) for g in grads):
        return grads
    return [None if filled(g) else g for g in grads]


class _Turns:
    """One open `loop_gradients_in_turn` context: per graph, what the loop
    gradient made last in it returned; and the chains a level reruns, in the
    order their gradients were built (`chain_differentiated`)."""

    def __init__(self):
        self.made = {}
        self.chains = []  # (a chain's first loop, the gradients of its inputs)


# Per thread (a tf.distribute strategy's replicas trace in threads): the open contexts.
_local = threading.local()


def _open_turns() -> list:
    return _local.__dict__.setdefault("open", [])


@contextlib.contextmanager
def loop_gradients_in_turn() -> Iterator[None]:
    """Within, the loop gradients decorated with `in_turn` run one after
    another, in the order they are built.

    Two independent loops (the directions of a Bidirectional RNN) differentiated
    in chunks each hold a chunk's stacks and their outputs' gradients; TF's
    executor ran both at once with several inter-op threads (a Bidirectional
    GRU, 64 steps: 15.8 MiB against 9.1 with one thread, 9.3 predicted; in
    turn 10.2, its step 8-16% longer). The wait runs from a gradient made
    earlier to one made later, as every ordering edge of the rewrite does, so
    it makes no cycle; a rerun made to wait (`start_reruns_in_turn`) is checked
    for one.
    """
    _open_turns().append(_Turns())
    try:
        yield
    finally:
        _open_turns().pop()


def in_turn(gradient):
    """Decorates a registered loop gradient `gradient(op, *grads, after)` so
    that it is built to wait for `after`, what the last loop gradient made in
    the op's graph returned (nothing outside `loop_gradients_in_turn`)."""
    return _taking_turns(gradient, dict)


def always_in_turn(gradient):
    """Like `in_turn`, and outside `loop_gradients_in_turn` too, in a record
    kept per thread: a user's own tf.gradients of our gradients (a second
    order) opens no context, yet its loop gradients should take turns."""
    return _taking_turns(gradient, _standing_record)


def _standing_record() -> "weakref.WeakKeyDictionary[tf.Graph, list]":
    return _local.__dict__.setdefault("standing", weakref.WeakKeyDictionary())


def _taking_turns(gradient, outside):
    """`gradient` waiting for what the record of the open context holds,
    else the record `outside()` gives (`dict`: a new one, so nothing)."""
    @functools.wraps(gradient)
    def taking_turns(op, *grads):
        turns = _open_turns()
        made = turns[-1].made if turns else outside()
        results = gradient(op, *grads, after=made.get(op.graph, ()))
        arrived = [g for g in results if g is not None]
        if arrived:
            made[op.graph] = arrived
        return results
    return taking_turns


def rerun_in_turn(first: tf.Operation) -> None:
    """Marks `first`, the first loop of a chain of chunks a level reruns: the
    chain reruns once the chain differentiated before it is done
    (`start_reruns_in_turn`)."""
    first._memory_saving_rerun_in_turn = True  # pylint: disable=protected-access


def chain_differentiated(first: tf.Operation, grads) -> None:
    """Records `grads`, the gradients of a chain's inputs, from the gradient
    of its first loop `first` (the chain's last gradient)."""
    turns = _open_turns()
    if turns and getattr(first, "_memory_saving_rerun_in_turn", False):
        turns[-1].chains.append((first, [g for g in grads if g is not None]))


def start_reruns_in_turn(graph) -> None:
    """Makes each chain of chunks a level reruns in `graph`, but the first
    differentiated, rerun only once the chain differentiated before it is
    done; unless that one's gradients depend on its rerun (a loop reading the
    other's outputs: data orders them).

    tf.gradients differentiates two independent chains' chunks alternately, and
    both ran at the level's start (a Bidirectional LSTM, 64 steps: 12.3-12.4
    MiB with default threading, 7.6-8.9 with one inter-op thread; in turn
    9.2-9.3 and 8.6-8.9). Called once the gradients are built: a wait added while
    they are would make the ops computing them look like forward ops to the
    rewrite (they would feed an op made before the tf.gradients call).
    """
    turns = _open_turns()
    if not turns:
        return
    chains = [(first, grads) for first, grads in turns[-1].chains if first.graph is graph]
    turns[-1].chains = [chain for chain in turns[-1].chains if chain[0].graph is not graph]
    for (_, before), (rerun, _) in zip(chains, chains[1:]):
        tied = _first_float(rerun.inputs)
        # Walked forward over the whole graph: the waits added here run from
        # newer ops to older ones.
        if tied is None or gradient_waits.reaches(rerun, {g.op for g in before}):
            continue
        gate = gradient_waits.gate(before)
        if gate is not None:
            compat.replace_input(rerun, tied,
                                 gradient_waits.seed_after_gate(rerun.inputs[tied], gate))


def _unfoldable(grads, state):
    """`grads` that XLA cannot take for constants: each dense float one plus
    a zero read from `state` (`gradient_waits.seed_after_gate`).

    A constant gradient (a loss's `0.1 * running_sum`) carried unchanged
    through the stock gradient's While is propagated into its body by XLA's
    bridge, which then fails to find the body it made for a loop nested in
    another loop's gradient ("Propagate: Cannot find body function
    ..._const_0"), as the gradients of our chunks are.
    """
    never = gradient_waits.gate([state])
    return [gradient_waits.seed_after_gate(g, never)
            if isinstance(g, tf.Tensor) and g.dtype.is_floating else g for g in grads]


def _first_float(inputs):
    """Index of a floating input to tie the rerun to (XLA folds `int * 0`)."""
    return next((i for i in range(2, len(inputs)) if inputs[i].dtype.is_floating), None)


def copy_while(loop, inputs, gradient=None, one_at_a_time=False):
    """A While op like `loop` reading `inputs`, with functions of its own and
    the gradient registered as `gradient` (None: the stock one).

    `one_at_a_time` (for chunks): one iteration in flight. Measured on a Keras
    LSTM (parallel_iterations=32), T=1000, chunks of 21: 60 MB peak with the
    loop's own setting, 9 MB with 1, at the same step time.
    """
    # Differentiating a loop appends data inputs to it, and a node's control
    # inputs must follow its data inputs: the loop itself waits through its inputs.
    attrs, dtypes = loop_recording.template(loop)
    with loop.graph.control_dependencies(None):
        new = compat.create_op_copy(loop.graph, loop, list(inputs), attrs, dtypes)
    compat.set_device(new, loop.device)
    compat.set_gradient_override(new, gradient)
    if one_at_a_time:
        compat.set_parallel_iterations(new, 1)
    give_own_loop_functions(new)
    for old_t, new_t in zip(loop.outputs, new.outputs):  # the recorded lists: none
        new_t.set_shape(old_t.shape)
    return new


def one_iteration_at_a_time(backprop_ops: list) -> None:
    """Lets the While ops among `backprop_ops` run one iteration at a time.

    A stock gradient loop with several iterations in flight runs its chain of
    state gradients ahead, and each iteration's weight-gradient partial waits
    for the running sum of those before it: with one inter-op thread (or two
    such loops at once on two) up to `parallel_iterations` partials are held.
    A budgeted plan of a Bidirectional GRU (64 steps, 256 units) that keeps
    its loops measured 44.7 MiB with one thread against 24.7 one iteration at
    a time (its budget 23.4), in about the same step time (default threading:
    223-231 ms against 248).
    """
    for op in backprop_ops:
        if op.type in loops.LOOP_OP_TYPES:
            compat.set_parallel_iterations(op, 1)


def give_own_loop_functions(loop: tf.Operation) -> None:
    """Gives a copied v2 while loop condition and body graphs of its own.

    Differentiating a while loop makes its functions output per-iteration
    accumulators, saved under the function's name + '_rewritten'. A copy
    sharing the original's function names would clash with the original (or
    another copy) being differentiated too, so it gets fresh names; while_v2
    reads these graphs from the op (`_cond_graph`, `_body_graph`).
    """
    for part in ("cond", "body"):
        name = loop.get_attr(part).name
        func_graph = compat.while_function_graph(loop, name)
        func_graph.name = f"{name}_recomputed_{compat.unique_id()}"
        setattr(loop, f"_{part}_graph", func_graph)
