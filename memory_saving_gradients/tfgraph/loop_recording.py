"""The forward pass of a long loop saves its own chunk-boundary states.

To differentiate a T-iteration v2 While loop in chunks of k, backprop needs
the loop-carried state at iterations 0, k, 2k, ... Rerunning the loop to get
them costs a third run of it; instead `record` gives the forward While op a
new body that also stores its input state into a TensorList every k
iterations, as while_v2's own gradient adds accumulator outputs to a forward
loop. The body gets no nested control flow: every iteration writes its state
into slot `i // k` if `i % k == 0`, else into a spare last slot. What the
loop computed before is unchanged; it only gains outputs (one list per saved
state) and inputs (the empty lists).

Not every carried tensor needs saving:
- loop invariants (captured weights, inputs read by index): the chunk reads
  the loop's own input;
- TensorLists the body only writes at fixed-size indices (TensorArray
  outputs): the chunk starts from the loop's input list. The gradient of a
  write never reads the list written to, and the writes a chunk makes are
  the ones its gradient needs.
Any other carried list or resource that changes cannot be saved here: the
loop is then rerun as a chain of chunks instead (`why_not`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Union

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import static_values

_LIST_WRITE = "TensorListSetItem"
_PASS_THROUGH = ("Identity",)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A chunked loop's `count` chunks of `size` iterations over its `bound`
    (its maximum_iterations): ints known now, or scalar tensors computed
    from a bound known only at run time."""

    count: int
    size: Union[int, tf.Tensor]
    bound: Union[int, tf.Tensor]

    def limit(self, chunk: int, dtype: tf.DType):
        """Iterations chunk `chunk` runs at most (its `maximum_iterations`):
        `size`, less for the last; none for a chunk past a run-time bound."""
        start = chunk * self.size
        if isinstance(self.bound, int) and isinstance(self.size, int):
            return tf.constant(min(self.size, self.bound - start), dtype)
        return tf.cast(tf.clip_by_value(self.bound - start, 0, self.size), dtype)


@dataclasses.dataclass(frozen=True)
class Recording:
    """What `record` did to a loop, for the chunks that read it."""

    layout: Layout           # its chunks: slots in use, iterations between them
    attrs: dict              # the loop's attributes before (chunks copy these)
    dtypes: List[tf.DType]   # its output dtypes before
    saved: Dict[int, int]    # carried input index -> index of the loop output listing it

    @property
    def num_inputs(self) -> int:
        return len(self.dtypes)


def recording(loop: tf.Operation) -> Optional[Recording]:
    """The recording `record` made of `loop`, if any."""
    return getattr(loop, "_memory_saving_recording", None)


def template(loop: tf.Operation):
    """(attributes, output dtypes) of `loop` as built by while_v2 (before any recording)."""
    found = recording(loop)
    if found is not None:
        return found.attrs, found.dtypes
    return dict(loop.node_def.attr), [t.dtype for t in loop.outputs]


def why_not(loop: tf.Operation) -> Optional[str]:
    """Why `loop` cannot save its chunk boundaries, or None if it can."""
    if recording(loop) is not None:
        return None
    if compat.any_tape_recording():
        # A tape that recorded the loop differentiates it later with the
        # inputs it saw: given more, while_v2's gradient returns too many
        # gradients ("returned too few gradients. Expected 4 but received 5").
        return "a GradientTape is recording, and it would differentiate the loop as it saw it"
    if compat.differentiated_by_stock(loop):
        return "it was already differentiated by tf.gradients (its op carries accumulators)"
    if static_values.static_value(loop.inputs[compat.WHILE_COUNTER]) != 0:
        return "its iteration counter does not start at 0"
    body = fresh_function(loop, "body")
    xla = compat.in_xla_context(loop.graph)
    for index in range(2, len(loop.inputs)):
        kind = _kind(body, index)
        if kind is None:
            return f"its carried {loop.inputs[index].dtype.name} input {index} changes"
        if kind == "saved" and xla and not body.inputs[index].shape.is_fully_defined():
            return f"under XLA, its carried input {index} has no fully known shape"
    return None


def record(loop: tf.Operation, layout: Layout) -> Recording:
    """Makes `loop` save its carried state at the start of each chunk of
    `layout` (see the module docstring); returns how.
    Call only when `why_not` is None."""
    found = recording(loop)
    if found is not None:
        return found
    size, count = layout.size, layout.count
    body, cond = fresh_function(loop, "body"), fresh_function(loop, "cond")
    saved = [i for i in range(2, len(loop.inputs)) if _kind(body, i) == "saved"]
    attrs, dtypes = template(loop)
    first_output = len(loop.outputs)
    new_inputs = [_initial_list(loop, body.inputs[i], loop.inputs[i], count + 1)
                  for i in saved]
    if isinstance(size, tf.Tensor):  # the body reads it as an invariant of its own
        new_inputs.append(tf.cast(size, loop.inputs[compat.WHILE_COUNTER].dtype))
    _add_list_writes(body, saved, size, count)
    with cond.as_default():
        cond.inputs.extend(tf.compat.v1.placeholder(t.dtype, []) for t in new_inputs)
    compat.add_loop_outputs(loop, cond, body, new_inputs)
    found = Recording(layout, attrs, dtypes,
                      {i: first_output + n for n, i in enumerate(saved)})
    loop._memory_saving_recording = found  # pylint: disable=protected-access
    return found


def saved_state(loop: tf.Operation, found: Recording, index: int, chunk: int) -> tf.Tensor:
    """Saved input `index` (a key of `found.saved`) at the start of `chunk`.

    A chunk that starts after the loop stopped (its condition ended it early)
    reads the final state instead: from there it runs no iteration. Its
    gradient, which only a second order asks for, is for the reader to give
    (loop_replay.py): through the recording lists TensorFlow's would be wrong.
    """
    dtype = loop.inputs[index].dtype
    ran = loop.outputs[compat.WHILE_COUNTER]
    size = tf.cast(found.layout.size, ran.dtype)
    last_written = tf.maximum(ran - 1, 0) // size
    slot = tf.minimum(tf.constant(chunk, ran.dtype), last_written)
    value = tf.raw_ops.TensorListGetItem(
        input_handle=loop.outputs[found.saved[index]], index=slot,
        element_shape=_shape_tensor(loop.inputs[index].shape), element_dtype=dtype)
    started = tf.constant(chunk, ran.dtype) * size < ran
    final = loop.outputs[index]
    if final.shape.is_fully_defined() and final.shape == loop.inputs[index].shape:
        return tf.where(started, value, final)
    # A state whose shape may change (shape_invariants): the two may differ
    # in shape, which a select refuses or, where a size is 1, broadcasts.
    return tf.cond(started, lambda: value, lambda: final)


def written_lists(loop: tf.Operation) -> List[tf.Tensor]:
    """The loop's input TensorLists that its body only writes to (outputs)."""
    body = fresh_function(loop, "body")
    count = len(template(loop)[1])
    return [loop.inputs[i] for i in range(2, count) if _kind(body, i) == "written"]


def fresh_function(loop, part):
    """A fresh FuncGraph of the loop's `part` ('cond' or 'body'), renamed."""
    graph = compat.while_function_graph(loop, loop.get_attr(part).name)
    graph.name = f"{graph.name}_recorded_{compat.unique_id()}"
    return graph


def passed_through(tensor: tf.Tensor) -> tf.Tensor:
    """`tensor` before the Identity ops it is passed on through (one buffer),
    IdentityN ones included (`tf.custom_gradient` returns its results so)."""
    while tensor.op.type in _PASS_THROUGH or tensor.op.type == "IdentityN":
        tensor = tensor.op.inputs[tensor.value_index]
    return tensor


def returned_value(body, index) -> tf.Tensor:
    """What `body` returns as its loop variable `index`, before the Identity
    ops it is passed on through."""
    return passed_through(body.outputs[index])


def is_invariant(body, index) -> bool:
    """True if `body` returns its loop variable `index` unchanged."""
    return returned_value(body, index) is body.inputs[index]


def _kind(body, index) -> Optional[str]:
    """'invariant', 'written' (a list only written to), 'saved' or None (cannot)."""
    given = body.inputs[index]
    if is_invariant(body, index):
        return "invariant"
    if given.dtype == tf.variant:
        return "written" if _only_written(given) else None
    return None if given.dtype == tf.resource else "saved"


def _only_written(handle) -> bool:
    """True if the TensorList `handle` flows only through fixed-size writes."""
    frontier = [handle]
    while frontier:
        current = frontier.pop()
        for consumer in current.consumers():
            written = (consumer.type == _LIST_WRITE and consumer.inputs[0] is current
                       and not consumer.get_attr("resize_if_index_out_of_bounds"))
            if not (written or consumer.type in _PASS_THROUGH):
                return False
            frontier.append(consumer.outputs[0])
    return True


def _add_list_writes(body, saved, size, count):
    """Body: each saved input also goes into its list, at slot i // size on
    chunk starts and at the spare slot `count` otherwise. A `size` tensor is
    read from an input after the lists' (an invariant: returned as given)."""
    with body.as_default():
        step = body.inputs[compat.WHILE_COUNTER]
        handles = [tf.compat.v1.placeholder(tf.variant, []) for _ in saved]
        body.inputs.extend(handles)
        carried = isinstance(size, tf.Tensor)
        if carried:
            size = tf.compat.v1.placeholder(step.dtype, [])
            body.inputs.append(size)
        starts = tf.equal(tf.math.floormod(step, size), 0)
        slot = tf.where(starts, tf.math.floordiv(step, size), tf.constant(count, step.dtype))
        body.outputs.extend(tf.raw_ops.TensorListSetItem(
            input_handle=handle, index=slot, item=body.inputs[index])
            for handle, index in zip(handles, saved))
        if carried:
            body.outputs.append(size)


def _initial_list(loop, inside, value, slots):
    """A list of `slots` elements like `inside`, slot 0 set to `value` (the
    loop's input) so that every slot a chunk may read exists."""
    with loop.graph.control_dependencies(None), tf.device(loop.device or None):
        empty = tf.raw_ops.TensorListReserve(
            element_shape=_shape_tensor(inside.shape), num_elements=slots,
            element_dtype=inside.dtype)
        return tf.raw_ops.TensorListSetItem(input_handle=empty, index=0, item=value)


def _shape_tensor(shape: tf.TensorShape) -> tf.Tensor:
    if shape.rank is None:
        return tf.constant(-1, tf.int32)
    return tf.constant([-1 if d is None else d for d in shape.as_list()], tf.int32)
