"""What a v2 While loop keeps for its stock gradient, asked of TensorFlow.

while_v2's gradient makes the forward loop push, every iteration, each body
tensor the gradient body reads onto a stack (a TensorList); the stacks live
from the loop's run until backprop reaches it, T iterations of them. Which
tensors those are is learnt by building the stock gradient once for a copy
of the loop on a scratch graph and reading the pushes in the rewritten body
(cached per body function and shapes); their bytes come from static shapes
(of the body as traced in Python when available: the imported function
loses the shapes of variables read inside it).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import tensorflow as tf

from memory_saving_gradients.core.model import Loop
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import graph_walks
from memory_saving_gradients.tfgraph import loop_bounds
from memory_saving_gradients.tfgraph import loop_chunks
from memory_saving_gradients.tfgraph import loop_recording
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import sized_shapes

logger = logging.getLogger("memory_saving_gradients")
_PUSH_OP_TYPE = "TensorListPushBack"
# List writes and the index of the item they write.
_ITEM_INPUT = {"TensorListSetItem": 2, _PUSH_OP_TYPE: 1}
# (body function name, the size unknown dimensions count as, input dtypes and
# shapes) -> iteration_bytes, per process.
_MEASURED = {}
# Loop inputs whose buffers exist before the step (arguments, constants, variables).
_HELD_BEFORE_OP_TYPES = frozenset({"Placeholder", "Const", "ReadVariableOp", "VarHandleOp"})
# Reads of a variable's rows, whose gradients are IndexedSlices: of its
# handle, and of its value (input 0).
_GATHER_OP_TYPES = frozenset({"ResourceGather", "ResourceGatherNd"})
_VALUE_GATHER_OP_TYPES = frozenset({"GatherV2", "Gather", "GatherNd"})
_NO_GRADIENT_OP_TYPES = frozenset({"StopGradient", "PreventGradient"})
# Pushed tensors that share a buffer kept anyway (a variable's value).
_SHARED_BUFFER_OP_TYPES = frozenset({"ReadVariableOp"})
# Body ops whose output is a buffer held elsewhere (a list's item, a variable's
# value, its input's): nothing computed ahead is held by them.
_VIEW_OP_TYPES = _SHARED_BUFFER_OP_TYPES | {"TensorListGetItem", "Identity", "Reshape",
                                            "ExpandDims", "Squeeze"}


def loop_facts(loop: tf.Operation, rerunnable: bool, region=frozenset(),
               differentiated=frozenset()) -> Loop:
    """The `core.model.Loop` of v2 While op `loop`; `rerunnable` if the rewrite
    may rerun it (then it is chunked when `loop_chunks.chunking` says so);
    `region`: the names of the tensors the planner models; `differentiated`:
    those gradients are asked for (the xs)."""
    size = loop_chunks.chunking(loop)[0] if rerunnable else None
    in_place, when_recomputed = loop_chunks.saves_states(loop, size) if size else (True, True)
    stacked, written = iteration_bytes(loop)
    # A list the model sees the bytes of (an output sequence) is counted as
    # the loop's output already, in the forward pass and in a rerun.
    seen = [index is not None and list_bytes(loop.outputs[index])
            != op_kinds.tensor_bytes(loop.outputs[index]) for index, _, _ in written]
    body, cond = loop_bounds.loop_function(loop), loop_bounds.loop_function(loop, "cond")
    return Loop(trip_count=loop_chunks.planned_trips(loop), iteration_bytes=stacked,
                written_bytes=sum(size for (_, size, _), known in zip(written, seen)
                                  if not known),
                stacked_items=tuple((loop.outputs[index].name, size)
                                    for (index, size, held), known in zip(written, seen)
                                    if known and held),
                state_bytes=sum(op_kinds.tensor_bytes(t) for t in loop.inputs[2:]
                                if t.dtype.is_floating),
                chunk_size=size, states_saved_in_place=in_place,
                states_saved_when_recomputed=when_recomputed,
                ahead_bytes=ahead_bytes(loop, body, cond),
                parallel_iterations=_parallel_iterations(loop),
                invariant_bytes=invariant_bytes(body),
                gathered_bytes=gathered_bytes(loop, body, differentiated),
                outside_bytes=_outside_bytes(loop, body, region))


def _outside_bytes(loop: tf.Operation, body, region) -> int:
    """Bytes of the loop's inputs made in the step outside `region` that a
    chunk reruns from: its lists and float invariants (a carried state's
    chunk boundaries are saved, the first of them its input). `body`: the
    loop's body as `loop_bounds.loop_function` reads it."""
    if body is None:
        return 0
    return sum(list_bytes(t) for index, t in enumerate(loop.inputs) if index >= 2
               and t.name not in region and t.op.type not in _HELD_BEFORE_OP_TYPES
               and (is_float_list(t) or (t.dtype.is_floating
                                         and loop_recording.is_invariant(body, index))))


def invariant_bytes(body) -> int:
    """Bytes of the loop invariants of `body` (a loop's, as
    `loop_bounds.loop_function` reads it) with float values (weights it
    reads, captured variables included): the gradient of each is summed over
    the iterations into a buffer of its size."""
    if body is None:
        return 0
    total = 0
    for index in range(2, len(body.outputs)):
        if not loop_recording.is_invariant(body, index):
            continue
        given = body.inputs[index]
        if given.dtype.is_floating:
            total += op_kinds.tensor_bytes(given)
        elif given.dtype == tf.resource:
            reads = [c.outputs[0] for c in given.consumers() if c.type == "ReadVariableOp"]
            total += max((op_kinds.tensor_bytes(t) for t in reads
                          if t.dtype.is_floating), default=0)
    return total


def gathered_bytes(loop: tf.Operation, body, differentiated) -> int:
    """Bytes of the float variables `body` (`loop`'s, as
    `loop_bounds.loop_function` reads it) gathers rows of, as loop
    invariants, among those `differentiated` (names of the tensors gradients
    are asked for): an embedding table read
    by `tf.gather` (its handle's, or a Keras Embedding's read value). Their
    gradients arrive sparse and are summed dense."""
    if body is None:
        return 0
    total = 0
    for index in range(2, len(body.outputs)):
        given, spec = body.inputs[index], None
        if (given.dtype == tf.resource and loop_recording.is_invariant(body, index)
                and loop_recording.passed_through(loop.inputs[index]).name in differentiated
                and _rows_read(given)):
            spec = compat.resource_spec(given)
        if spec is not None and spec.dtype.is_floating and spec.shape.is_fully_defined():
            total += spec.shape.num_elements() * spec.dtype.size
    return total


def _rows_read(handle: tf.Tensor) -> bool:
    """True if a gather reads rows of the variable behind `handle` for a
    value with a gradient (not only through tf.stop_gradient)."""
    gathers = [c for c in handle.consumers() if c.type in _GATHER_OP_TYPES]
    for read in (c.outputs[0] for c in handle.consumers() if c.type == "ReadVariableOp"):
        gathers += [c for c in read.consumers()
                    if c.type in _VALUE_GATHER_OP_TYPES and c.inputs[0] is read]
    return any(c.type not in _NO_GRADIENT_OP_TYPES
               for gather in gathers for c in gather.outputs[0].consumers())


def _parallel_iterations(loop: tf.Operation) -> int:
    """The loop's `parallel_iterations`; the op's default (10) where a graph
    imported without default attributes lacks it."""
    try:
        return loop.get_attr("parallel_iterations")
    except ValueError:
        return 10


def ahead_bytes(loop: tf.Operation, body, cond) -> int:
    """Bytes per iteration of `loop`'s body values that do not depend on its
    carried state and are read by what does (an RNN's input projection
    `x_t @ W`, read by `+ h @ U`). The executor runs each iteration's ops as
    soon as their inputs exist, so it computes these for later iterations
    while the recurrence is still on earlier ones, each held until its
    iteration's state arrives (measured: a Keras LSTM of 16 steps holding 17
    projections of 64 KiB at once).

    The carried state is what the body changes but counters: its float
    tensors and lists, and any value computed from them (an index read from
    h). None where the condition reads the state (the next iteration starts
    only once it is decided), and under XLA, which compiles the loop.
    `body`, `cond`: the loop's functions as `loop_bounds.loop_function` reads them.
    """
    if compat.in_xla_context(loop.graph):
        return 0
    if body is None or cond is None:
        return 0
    carried = [not loop_recording.is_invariant(body, i) for i in range(len(body.outputs))]
    state = {i for i, t in enumerate(body.inputs)
             if carried[i] and (t.dtype.is_floating or t.dtype == tf.variant)}
    while True:
        dependent = graph_walks.ops_reading(body.inputs[i] for i in state)
        more = {i for i in range(len(body.outputs)) if carried[i] and i not in state
                and loop_recording.returned_value(body, i).op in dependent}
        if not more:
            break
        state |= more
    if graph_walks.ops_reading(cond.inputs[i] for i in state if i < len(cond.inputs)):
        return 0
    return sum(op_kinds.tensor_bytes(t) for op in body.get_operations()
               if op not in dependent and op.inputs and op.type not in _VIEW_OP_TYPES
               for t in op.outputs
               if t.dtype.is_floating and any(c in dependent for c in t.consumers()))


def list_bytes(t: tf.Tensor) -> int:
    """Bytes of `t`; for a TensorList of floats, the bytes of its items.

    A list made from a tensor (a loop's input sequence) holds a copy of it,
    item by item; a list read whole by a TensorListStack (a loop's output
    sequence) holds what the stack gives. Other tensors: their static bytes.
    """
    source = _list_source(t)
    if source is None:
        return op_kinds.tensor_bytes(t)
    if source.type == "TensorListFromTensor":
        return op_kinds.tensor_bytes(source.inputs[0])
    stacks = [c.outputs[0] for c in t.consumers() if c.type == "TensorListStack"]
    return max(op_kinds.tensor_bytes(s) for s in stacks)


def is_float_list(t: tf.Tensor) -> bool:
    """True for a TensorList whose items are floats (its gradient is a list too)."""
    source = _list_source(t)
    return source is not None and tf.as_dtype(source.get_attr("element_dtype")).is_floating


def _list_source(t: tf.Tensor) -> Optional[tf.Operation]:
    """The op that tells what a TensorList `t` holds: the TensorListFromTensor
    that made it, or a TensorListStack that reads it whole; None otherwise."""
    if t.dtype != tf.variant:
        return None
    if t.op.type == "TensorListFromTensor":
        return t.op
    return next((c for c in t.consumers() if c.type == "TensorListStack"), None)


def loop_cost(loop: tf.Operation) -> int:
    """Rough FLOPs of a run of `loop`: its bound (1 if unknown) times those of
    its body's ops; the op's own rough cost if the body cannot be read."""
    body = loop_bounds.loop_function(loop)
    if body is None:
        return op_kinds.op_cost(loop)
    per_iteration = sum(op_kinds.op_cost(op) for op in body.get_operations())
    return loop_chunks.trips(loop) * per_iteration


def iteration_bytes(loop: tf.Operation) -> tuple:
    """(bytes the stock gradient of `loop` stacks, ((index of the loop
    variable holding the list or None, bytes, whether the stacks hold that
    item too) of each write its body makes into a TensorList it carries))
    per iteration; (0, ()) if unknown."""
    key = (loop.get_attr("body").name, sized_shapes.assumed_size(),
           tuple((t.dtype.name, str(t.shape)) for t in loop.inputs))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(loop)
    return _MEASURED[key]


def _measure(loop):
    traced = compat.traced_function_graph(loop, "body")
    try:
        written, pushed, held = _probe(loop)
        return (_pushed_bytes(pushed, traced),
                tuple((index, _bytes(t, traced), _buffer_of(t).ref() in held)
                      for index, t in written))
    except Exception:  # pylint: disable=broad-except  # a loop we cannot probe: unknown
        logger.debug("loop %s not probed", loop.name, exc_info=True)
        return 0, ()
    finally:
        _called_functions.cache_clear()  # the probe's scratch graphs go with it


@functools.lru_cache(maxsize=None)
def _called_functions(op: tf.Operation) -> tuple:
    """`compat.called_function_graphs(op)`, imported once per op of a probe."""
    return compat.called_function_graphs(op)


def _pushed_bytes(pushed: list, traced: Optional[tf.Graph]) -> int:
    """Bytes an iteration's pushes keep: the tensors', and for the stacks of a
    loop nested in the body (pushed as that loop's TensorLists), T of its own
    iterations' pushes."""
    nested = {t.op for t in pushed if t.dtype == tf.variant and t.op.type in loops.LOOP_OP_TYPES}
    return (sum(_held_bytes(t, traced) for t in pushed)
            + sum(_nested_stack_bytes(inner) for inner in nested))


def _nested_stack_bytes(inner: tf.Operation) -> int:
    """Stacks of a loop in a probed body, as while_v2 rewrote it for its gradient."""
    body = loop_bounds.loop_function(inner)
    if body is None:
        return 0
    pushed, _ = _stacked_buffers(body, [op.inputs[1] for op in body.get_operations()
                                        if op.type == _PUSH_OP_TYPE])
    return loop_chunks.trips(inner) * _pushed_bytes(pushed, None)


def _stacked_buffers(body, pushed: list) -> tuple:
    """(the tensors of `pushed` that hold a buffer of their own each
    iteration, Tensor.ref()s of every body value the stacks hold).

    A tensor pushed under several names (Identity ops) is one buffer. So is a
    value the body returns as loop variable i when the stacks also take input
    i: what iteration t pushes as its result, iteration t + 1 pushes again as
    its input (measured: tanh(h @ W) keeps one [B, H] buffer per iteration,
    not two, though the gradients of tanh and of the matmul push both).
    """
    buffers = {}  # Tensor.ref() of a buffer -> one tensor holding it
    for t in pushed:
        buffers.setdefault(_buffer_of(t).ref(), t)
    held = set(buffers)
    for index, given in enumerate(body.inputs[:len(body.outputs)]):
        returned = _buffer_of(body.outputs[index])
        if given.ref() in held and returned is not given:
            held.add(returned.ref())
            buffers.pop(returned.ref(), None)
    return list(buffers.values()), held


def _buffer_of(t: tf.Tensor) -> tf.Tensor:
    """The body tensor whose buffer `t` is: before the Identity ops it is
    passed on through, and before a function call or `tf.cond` that returns
    it unchanged. (Differentiated, a call returns what its backward function
    reads, its own inputs among them; a cond each branch's such values,
    wrapped in optionals.) `t` itself where the branches disagree."""
    t = loop_recording.passed_through(t)
    while True:
        functions, arguments = _called_functions(t.op)
        found = {_buffer_in(function, arguments, t) for function in functions} - {None}
        if len(found) != 1:
            return t
        (found,) = found
        if found.deref() is t:
            return t
        t = found.deref()


def _buffer_in(function, arguments, t: tf.Tensor):
    """Tensor.ref() of the outer tensor whose buffer `function` (run by
    `t.op`, reading `arguments`) returns as `t`: an argument, or `t.op`'s
    first output it returns that value at, passed through Identity ops and
    out of an optional. None if it returns nothing there (an empty optional)."""
    inner = _value_in(function.outputs[t.value_index])
    if inner is None:
        return None
    if compat.compiled_call(t.op):  # XLA returns every result in a buffer of its own
        return t.ref()
    given = [a.ref() for a in function.inputs]
    if inner.ref() in given:
        return loop_recording.passed_through(arguments[given.index(inner.ref())]).ref()
    returned = [loop_recording.passed_through(o).ref() for o in function.outputs]
    return t.op.outputs[returned.index(inner.ref())].ref() if inner.ref() in returned else t.ref()


def _value_in(returned: tf.Tensor) -> Optional[tf.Tensor]:
    """What a function returns as `returned`: passed through Identity ops,
    and out of an optional (None for an empty one)."""
    returned = loop_recording.passed_through(returned)
    if returned.op.type == "OptionalNone":
        return None
    if returned.op.type == "OptionalFromValue" and len(returned.op.inputs) == 1:
        return loop_recording.passed_through(returned.op.inputs[0])
    return returned


def _held_bytes(t: tf.Tensor, traced: Optional[tf.Graph]) -> int:
    """Bytes of a pushed `t` (one buffer of its own): none for a variable's
    value, which the variable holds anyway; else those of the body tensor it
    is (`_buffer_of`; for an optional a cond returns, the one it holds)
    where that shape is known, else of the larger value the functions its
    op runs return there."""
    functions, _ = _called_functions(t.op)
    values = [v for v in (_value_in(f.outputs[t.value_index]) for f in functions) if v is not None]
    if any(v.op.type in _SHARED_BUFFER_OP_TYPES for v in values + [t]):
        return 0
    buffer = _buffer_of(t)
    if buffer.dtype != tf.variant:
        values = [buffer] + values
    # The first known: the buffer's static shape (or its traced twin's), else
    # the values as the functions compute them from their inputs' shapes.
    for value in values:
        known = _known_bytes(value, traced if value is buffer else None)
        if known is not None:
            return known
    return max((_bytes(v, traced if v is buffer else None) for v in values), default=0)


def _probe(loop):
    """(the body tensors written into lists, those while_v2's gradient pushes
    onto its stacks, the buffers these hold: `_stacked_buffers`) per
    iteration, for a copy of `loop` on a scratch graph (the user's graph is
    left untouched)."""
    scratch = tf.Graph()
    with scratch.as_default():
        inputs = [tf.compat.v1.placeholder(t.dtype, t.shape) for t in loop.inputs]
        for old, new in zip(loop.inputs, inputs):
            if old.dtype in (tf.resource, tf.variant):
                compat.copy_handle_data(old, new)
        copy = compat.create_op_copy(scratch, loop, inputs, keep_shapes=True)
        compat.set_gradient_override(copy, None)
        for old, new in zip(loop.outputs, copy.outputs):
            if old.dtype in (tf.resource, tf.variant):
                compat.copy_handle_data(old, new)
        for part in ("cond", "body"):
            func_graph = compat.while_function_graph_in(loop, loop.get_attr(part).name, scratch)
            # Functions are registered process-wide by name: the stock gradient
            # of the user's loop will add its own '<name>_rewritten'.
            func_graph.name = f"{func_graph.name}_probe_{compat.unique_id()}"
            compat.set_while_function_graph(copy, part, func_graph)
        written = _list_items(compat.traced_function_graph(copy, "body"))
        seeds = [tf.compat.v1.placeholder(t.dtype, t.shape) if t.dtype.is_floating else None
                 for t in copy.outputs]
        compat.gradient_function(copy)(copy, *seeds)
        body = compat.traced_function_graph(copy, "body")
        return (written, *_stacked_buffers(body, [op.inputs[1] for op in body.get_operations()
                                                  if op.type == _PUSH_OP_TYPE]))


def _list_items(body):
    """(index of the loop variable holding the list or None, tensor) of each
    tensor `body` writes into a TensorList (a loop's per-step outputs)."""
    return [(_list_variable(body, op.inputs[0]), op.inputs[_ITEM_INPUT[op.type]])
            for op in body.get_operations() if op.type in _ITEM_INPUT]


def _list_variable(body, handle):
    """Index in `body`'s inputs of the loop variable `handle` was written from."""
    while handle.op.type in _ITEM_INPUT:
        handle = handle.op.inputs[0]
    return next((i for i, t in enumerate(body.inputs) if t is handle), None)


def _bytes(tensor: tf.Tensor, traced: Optional[tf.Graph]) -> int:
    """Static bytes of `tensor`, from the traced body where it knows more
    (`op_kinds.tensor_bytes`)."""
    twin = None if tensor.shape.is_fully_defined() else _twin(tensor, traced)
    return op_kinds.tensor_bytes(tensor if twin is None else twin)


def _known_bytes(tensor: tf.Tensor, traced: Optional[tf.Graph]) -> Optional[int]:
    """`_bytes` of `tensor` where that shape is fully known; else None."""
    twin = None if tensor.shape.is_fully_defined() else _twin(tensor, traced)
    shown = tensor if twin is None else twin
    return op_kinds.tensor_bytes(shown) if shown.shape.is_fully_defined() else None


def _twin(tensor: tf.Tensor, traced: Optional[tf.Graph]) -> Optional[tf.Tensor]:
    """The tensor of `tensor`'s name in the traced body `traced`, if any."""
    if traced is None:
        return None
    try:
        return traced.get_tensor_by_name(tensor.name)
    except (KeyError, ValueError):
        return None
