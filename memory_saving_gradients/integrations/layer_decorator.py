"""`@recompute_grad` on a Keras layer's `call`: the layer becomes one recomputed segment.

When the switch is on (environment variable RECOMPUTE=1, or checkpointing in
force through `checkpointing(...)` / the Keras `Checkpointing` callback), a
decorated call builds its body behind a gradient boundary
(`tf.custom_gradient`). Only the body's inputs, outputs and the tensors that
cannot be recomputed (random ops, control flow) are kept; the gradient of the
boundary is our own rewrite (`memory_saving_gradients.gradients` with the
layer's outputs as the only checkpoints), which copies the body's ops to run
after the incoming gradient. Copies read the kept outputs of stateful ops, so
dropout masks are the same, and ops off the path to the outputs (batch-norm
moving-average updates) are never copied, so statistics are updated once.

Keyword arguments (`training=`, `mask=`) and non-float arguments are closed
over instead of passed through `tf.custom_gradient`, which in graph mode
accepts no keywords (what makes `tf.recompute_grad` and `keras.RematScope`
fail on such layers).

When the switch is off the decorated call is the undecorated call: the same
ops, the same gradients. Under RECOMPUTE=1 a Keras optimizer's update traced
into a graph holding a segment waits for its gradients, as in a checkpointed
step (integrations/optimizer_waits.py).
"""

import functools
import inspect
import logging
import os
import sys
import threading
import weakref
from typing import Callable, Mapping, Optional

import keras
import tensorflow as tf

from memory_saving_gradients import api
from memory_saving_gradients.integrations import optimizer_waits
from memory_saving_gradients.integrations import patching
from memory_saving_gradients.tfgraph import backward_copies
from memory_saving_gradients.tfgraph import captures, compat, gradient_linearity, gradient_reads
from memory_saving_gradients.tfgraph import gradient_paths, gradient_waits
from memory_saving_gradients.tfgraph import ledger

logger = logging.getLogger("memory_saving_gradients")

ENV_VAR = "RECOMPUTE"
_ON_VALUES = frozenset({"1", "true", "yes"})
_OFF_VALUES = frozenset({"0", "false", "no", ""})


def parse_switch(environ: Mapping[str, str]) -> bool:
    """The RECOMPUTE setting in `environ`: 1/true/yes on; 0/false/no/empty/unset off.

    Raises:
      ValueError: for any other value (never silently off).
    """
    raw = environ.get(ENV_VAR)
    value = "" if raw is None else raw.strip().lower()
    if value in _ON_VALUES:
        return True
    if value in _OFF_VALUES:
        return False
    raise ValueError(
        f"{ENV_VAR}={raw!r} is not understood: set {ENV_VAR}=1 (or true/yes) to "
        f"recompute layers decorated with @recompute_grad, {ENV_VAR}=0 (or "
        f"false/no, or leave it unset) not to")


# Read once per run, at import: a bad value fails here, not mid-training.
_ENV_ON = parse_switch(os.environ)


def recompute_enabled() -> bool:
    """True if decorated layers build as recomputed segments where traced now.

    On when RECOMPUTE was on at import, or while checkpointing is in force
    (`checkpointing(...)`, the Keras `Checkpointing` callback).
    """
    return _ENV_ON or patching.active_checkpoints() is not None


# Decorated calls being built on this thread (`depth`). Inside one, nested
# decorated layers build plainly, as the outer segment recomputes them anyway
# (their class names: `inner`).
_building = threading.local()
_logged = set()  # messages logged once per process
# The function graphs that hold a segment built under RECOMPUTE=1, and those
# they are nested in: a Keras optimizer's update traced into one waits for its
# gradients (integrations/optimizer_waits.py), as in a checkpointed step.
_graphs_with_segments = weakref.WeakSet()


def _holds_a_segment() -> bool:
    """Whether the graph being built holds a segment made under RECOMPUTE=1
    (optimizer_waits' reason for the decorator; installed for the run)."""
    return tf.compat.v1.get_default_graph() in _graphs_with_segments


def _updates_in_graph_wait(graph) -> None:
    """Makes optimizer updates traced into `graph`, or a function graph it is
    nested in, wait for their gradients."""
    while hasattr(graph, "outer_graph"):  # a FuncGraph
        _graphs_with_segments.add(graph)
        graph = graph.outer_graph
    optimizer_waits.install(_holds_a_segment)


def recompute_grad(call: Callable) -> Callable:
    """Decorates a Keras `Layer.call` so the layer is one recomputation segment.

    Example:
      >>> class Block(keras.layers.Layer):
      ...     @recompute_grad
      ...     def call(self, x, training=None):
      ...         return self.dense2(self.dropout(self.dense1(x), training=training))
      >>> class RecomputedDense(keras.layers.Dense):
      ...     @recompute_grad
      ...     def call(self, inputs):
      ...         return super().call(inputs)

    Eagerly (Keras `run_eagerly=True`) there is no graph to rewrite: the
    layer runs undecorated and a warning is logged once. So does a layer whose
    body holds a gradient override not linear in the incoming gradient (a
    clipping `tf.custom_gradient`), where a segment would make second orders
    wrong.

    Raises:
      TypeError: if `call` is not a function named `call` defined in a class
        body (a class, a layer instance, a bound method or a plain function).
    """
    _check_is_call_method(call)

    @functools.wraps(call)
    def recomputed_call(self, *args, **kwargs):
        if not isinstance(self, _layer_types()):
            raise TypeError(
                f"@recompute_grad decorates the call method of a keras.layers.Layer "
                f"subclass (Keras 3, or tf_keras's), but {call.__qualname__} was called "
                f"on a {type(self).__name__}; subclass keras.layers.Layer")
        if recompute_enabled() and getattr(_building, "depth", 0):
            _building.inner.add(type(self).__name__)  # the outer segment recomputes it
            return call(self, *args, **kwargs)
        if not recompute_enabled() or _builds_plainly(self):
            return call(self, *args, **kwargs)
        return _call_as_segment(call, self, args, kwargs)

    return compat.wraps_for_tf_inspect(call, recomputed_call)


def _layer_types() -> tuple:
    """Keras 3's Layer, and legacy tf_keras's (`TF_USE_LEGACY_KERAS=1`) once
    the process has imported it: a layer of it was built from that import."""
    legacy = sys.modules.get("tf_keras")
    return (keras.layers.Layer,) + ((legacy.layers.Layer,) if legacy is not None else ())


def _builds_plainly(layer: keras.layers.Layer) -> bool:
    """True where a segment cannot be built though the switch is on (said once)."""
    if tf.executing_eagerly():
        _log_once("@recompute_grad layers run eagerly (run_eagerly=True?) and are "
                  "not recomputed: recomputation rewrites a graph; train in a "
                  "tf.function (Keras's default) to save memory")
        return True
    if compat.in_control_flow_body(tf.compat.v1.get_default_graph()):
        # The loop's or cond's gradient is built in a graph of its own (from a
        # rebuilt copy of this body when our rewrite copies the loop), where
        # the tensors our gradient would read do not exist.
        _log_once(f"{type(layer).__name__}: @recompute_grad layers called inside a "
                  f"while loop or cond (an RNN cell?) are not recomputed; decorate "
                  f"the layer holding the loop instead")
        return True
    # SavedModel traces every custom gradient in a graph of its own, where the
    # body's tensors do not exist; a saved model needs no recomputation.
    return compat.in_save_context()


def _check_is_call_method(obj) -> None:
    usage = ("write @recompute_grad directly above `def call(self, ...)` in a "
             "keras.layers.Layer subclass, or subclass an existing layer: "
             "`class MyDense(keras.layers.Dense): @recompute_grad def call(self, "
             "inputs): return super().call(inputs)`")
    if inspect.isclass(obj) or isinstance(obj, _layer_types()):
        raise TypeError(f"@recompute_grad got {obj!r}, a layer or class, not its "
                        f"call method: {usage}")
    if inspect.ismethod(obj):
        raise TypeError(f"@recompute_grad got the bound method {obj.__qualname__}; "
                        f"decorate the function in the class body instead: {usage}")
    qualname = getattr(obj, "__qualname__", "").split(".")
    in_class = len(qualname) > 1 and qualname[-2] != "<locals>"
    if not inspect.isfunction(obj) or obj.__name__ != "call" or not in_class:
        raise TypeError(
            f"@recompute_grad got {obj!r}, which is not a layer's call method: {usage}. "
            f"For a plain function use memory_saving_gradients.gradients with "
            f"checkpoints instead")


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("memory_saving_gradients: %s", message)


def _is_differentiable_input(value) -> bool:
    return isinstance(value, tf.Tensor) and value.dtype.is_floating


def _call_as_segment(call: Callable, layer: keras.layers.Layer, args: tuple,
                     kwargs: dict):
    """`call(layer, *args, **kwargs)` behind a gradient boundary whose gradient
    recomputes the body. Float tensors anywhere in args/kwargs are its inputs;
    everything else (training flags, masks, Python values) is closed over.
    So are tensors the body reads without being given them (an attribute
    another layer set): they cross the boundary as inputs too, found once
    the body is built, so a gradient there still reaches what made them."""
    leaves = tf.nest.flatten((args, kwargs))
    slots = [i for i, v in enumerate(leaves) if _is_differentiable_input(v)]
    outer = [leaves[i] for i in slots]
    # tf.custom_gradient wants each input's own (partial) gradient. The body
    # reads stand-ins, so that one input computed from another, or passed
    # twice, gets only the gradient of its own reads: differentiated from the
    # outer tensors, the path between them would be counted here and again by
    # the backprop outside.
    inputs = [tf.identity(t) for t in outer]
    for tensor, stand_in in zip(outer, inputs):
        # Keras layers inside read it (pooling, attention): without it they
        # would not mask.
        compat.copy_keras_mask(tensor, stand_in)
    filled = list(leaves)
    for slot, tensor in zip(slots, inputs):
        filled[slot] = tensor
    graph = tf.compat.v1.get_default_graph()
    made, body_ops, read_variables = _built_body(
        graph, call, layer, *tf.nest.pack_sequence_as((args, kwargs), filled))
    # The outputs of its conds, loops and calls as built: differentiated,
    # TensorFlow adds outputs to them (`gradient_paths.gradient_missing_at`).
    holders = {op: range(len(op.outputs)) for op in body_ops
               if gradient_paths.holds_functions(op)}
    # tf.custom_gradient passes a RaggedTensor or SparseTensor through without
    # a gradient, and refuses None or Python values: only the float tensors (a
    # composite's components among them) cross it; the rest (indices, shapes,
    # ints, None) is packed again below as the body made it.
    outputs = [t for t in tf.nest.flatten(made, expand_composites=True)
               if _is_differentiable_input(t)]
    # Walked on first use: a body reading no trainable tensor from outside
    # and no non-trainable weight a tape tracks, whose sources reach no op
    # without a gradient, never walks.
    coming_back = functools.cache(
        lambda: gradient_paths.gradient_comes_back_from(body_ops, outputs))
    closures = (_closures(graph, body_ops, inputs, outputs, coming_back)
                + _reads_a_tape_watches(graph, body_ops, read_variables, coming_back))
    unliftable = [t for t in closures if not t.dtype.is_floating]
    if unliftable:
        # A complex or TensorList closure: not through the boundary (our
        # rewrite differentiates real floats), so the layer stays as built.
        _log_once(f"{type(layer).__name__}: its call reads {unliftable[0].name}, a "
                  f"{unliftable[0].dtype.name} tensor made outside it, so it is not a "
                  f"recomputed segment; TensorFlow differentiates it as it is. Pass the "
                  f"tensor as an argument of call to recompute the layer")
        return made
    plain = _why_built_plainly(body_ops, coming_back)
    if plain:
        name, inner = type(layer).__name__, sorted(_building.inner)
        inside = (f"; the @recompute_grad layers it calls ({', '.join(inner)}) built "
                  f"plainly inside it, so none of them is a segment either: to recompute "
                  f"those that hold no such override, leave {name} undecorated"
                  if inner else "")
        _log_once(f"{name}: its call holds {plain}, so it is not a recomputed segment; "
                  f"TensorFlow differentiates it as it is{inside}")
        return made
    sources = inputs + closures
    boundary = []

    @tf.custom_gradient
    def segment(*unused_sources):
        # The body is built: tf.custom_gradient hands `gradient` the variables
        # it reads only if it sees them read here.
        compat.note_variables_read(read_variables)

        def gradient(*output_grads, variables: Optional[list] = None):
            output_grads = [None if _filled_in(g, result) else g
                            for g, result in zip(output_grads, boundary)]
            grads = _recomputed_gradients(graph, outputs, body_ops, holders, coming_back,
                                          sources, variables or [], output_grads)
            source_grads = _after_weight_gradients(grads[:len(sources)], grads[len(sources):])
            return (source_grads, grads[len(sources):]) if variables else source_grads

        return outputs, gradient

    results = segment(*outer, *closures)
    # Its gradient is our rewrite's through the body: linear where the body's
    # overrides are, so the segment may be recomputed (the probe cannot build
    # it off its graph).
    gradient_linearity.declare_linear(results)
    boundary.extend(results)
    if _ENV_ON:  # else a patch is in force, whose reason makes updates wait
        _updates_in_graph_wait(graph)
    floats = iter(results)
    parts = []
    for part in tf.nest.flatten(made, expand_composites=True):
        if _is_differentiable_input(part):
            parts.append(next(floats))
            compat.copy_keras_mask(part, parts[-1])  # Keras set it on the body's outputs
        else:
            parts.append(part)
    return tf.nest.pack_sequence_as(made, parts, expand_composites=True)


def _why_built_plainly(body_ops: list, coming_back: Callable[[], set]) -> str:
    """What in the body a segment's gradient could not differentiate as
    stock does ('' if nothing), for a gradient override on the way back."""
    for op in body_ops:
        override = compat.override_tapes_ignore(op)
        if override is not None and any(id(t) in coming_back() for t in op.outputs):
            # The segment's gradient is built by tf.gradients, which follows
            # the override, whoever asks: a tape differentiating the plain
            # body would not.
            return (f"{op.name} ({op.type}), given the gradient {override} by "
                    f"gradient_override_map, which tf.gradients uses and a GradientTape "
                    f"ignores")
    if not gradient_linearity.overrides_linear(
            body_ops, lambda op: gradient_reads.gradient_reads(op).linear):
        # A second order through the boundary would reach the override in two
        # parts (through our gradient's copies and through the boundary's own
        # gradient) and apply it to each: clip(a) + clip(b), not clip(a + b).
        # The body's own outputs bypass the boundary, left unread; the
        # rewrite outside keeps such overrides' ops (stock gradients there).
        return ("a gradient override that is not linear in the incoming gradient (a "
                "clipping tf.custom_gradient?), through which a second order would be wrong")
    return ""


def _built_body(graph, call: Callable, layer, call_args: tuple, call_kwargs: dict) -> tuple:
    """(what `call` returns, the ops it made in creation order, the trainable
    variables it read); decorated layers it calls build plainly inside it."""
    first_op = len(graph.get_operations())
    _building.depth, _building.inner = getattr(_building, "depth", 0) + 1, set()
    try:
        with compat.variables_read() as variables:
            made = call(layer, *call_args, **call_kwargs)
    finally:
        _building.depth -= 1
    return made, graph.get_operations()[first_op:], variables


def _closures(graph, body_ops: list, stand_ins: list, outputs: list,
              coming_back: Callable[[], set]) -> list:
    """The tensors the body reads that it neither made nor was given (made
    outside it, or captured from an enclosing graph or eagerly, by the capture
    op, a placeholder or a constant, its first use made) from which a
    gradient at `outputs` comes back (ids in `coming_back()`). One read only
    through `tf.stop_gradient` stays outside the boundary: its maker gets
    None, not zeros."""
    inside, own = set(body_ops), {id(t) for t in stand_ins}
    read = [t for op in body_ops for t in op.inputs] + list(outputs)  # returned as it is
    outside = {id(t): t for t in read if t.op not in inside and id(t) not in own}
    made_here = [op for op in body_ops if op.type in ("Const", "Placeholder")]
    if made_here:  # the graph's captures are listed only then: one list per call
        captured = {id(inner) for _, inner in compat.captured_pairs(graph)}
        outside.update((id(t), t) for op in made_here for t in op.outputs if id(t) in captured)
    candidates = [t for t in outside.values()
                  if compat.is_trainable(t) and t.dtype != tf.resource]  # variables go apart
    return [t for t in candidates if id(t) in coming_back()]


def _reads_a_tape_watches(graph, body_ops: list, trainable_read: list,
                          coming_back: Callable[[], set]) -> list:
    """Values the body reads of variables `tf.custom_gradient` is not told
    of (it is told of `trainable_read`) that a recording tape tracks (one
    told to watch a non-trainable weight before the call was traced) and
    from which a gradient comes back. They cross the boundary as closures
    do, and the tape takes their gradient on to the variable through the
    read. No gradient op is made for weights no tape watches (`tf.gradients`
    of such a handle outside a watching tape still gets None)."""
    told = {id(handle) for handle in _local_handles(graph, trainable_read)}
    return [op.outputs[0] for op in body_ops
            if op.type == "ReadVariableOp" and id(op.inputs[0]) not in told
            and op.outputs[0].dtype.is_floating and compat.tape_would_record(op.outputs)
            and id(op.outputs[0]) in coming_back()]


def _taken_as_constants(body_ops: list, holders: dict, reached: set,
                        coming_back: Callable[[], set]) -> list:
    """Outputs of the body's ops where a gradient would meet an op without
    one (`gradient_paths.gradient_missing_at`: the op itself, or a cond,
    loop or function call holding it, in `holders` with its outputs as
    built) that depend on a source (an input in
    `reached`, through any op, as tf.gradients sees it) and lead to the
    body's outputs through ops passing gradients (a float or complex output
    in `coming_back()`): the segment's gradient stops there, as at
    `tf.stop_gradient` (said once per op type). The segment differentiates
    every source, asked for or not: raising there as tf.gradients does would
    fail a step stock trains, one whose batch alone reaches such an op."""
    maybe = [op for op in body_ops if gradient_paths.lacks_gradient(op) or op in holders]
    missing = {op: gradient_paths.gradient_missing_at(op, holders.get(op)) for op in maybe
               if any(id(t) in reached for t in op.inputs)
               and any(compat.is_trainable(t) and id(t) in coming_back() for t in op.outputs)}
    ops = [op for op, op_type in missing.items() if op_type is not None]
    for holder, op_type in sorted({(op.type, missing[op]) for op in ops}):
        taken = ("them" if holder == op_type else
                 f"the {holder} ops holding them (a cond, loop or function call) whole")
        _log_once(f"{op_type} ops inside @recompute_grad layers have no gradient registered: "
                  f"the layers' gradients take {taken} as constants, as tf.stop_gradient "
                  f"does. A weight or tensor whose gradient would pass through one gets None, "
                  f"or the part not through it, where stock TensorFlow raises LookupError if "
                  f"asked. Register a gradient for {op_type}, or wrap its output in "
                  f"tf.stop_gradient to say it is a constant")
    return [t for op in ops for t in op.outputs]


def _recomputed_gradients(graph, outputs, body_ops: list, holders: dict,
                          coming_back: Callable[[], set], sources: list, variables: list,
                          output_grads: tuple) -> list:
    """Gradients of the sources (stand-ins, closures) then variables,
    recomputing the body from them.

    The body's float outputs are the only checkpoints, so everything between
    them and the sources is one segment, copied to wait for `output_grads`.
    Each source gets the gradient of the body's own reads of it (a closure
    made from an input's tensor is not differentiated through that input).
    A variable gets the gradient of its reads inside the body only: reads
    outside it (feeding the inputs, or another call of the same layer) get
    theirs from the tape, and differentiating down to the variable itself
    would count them a second time. `coming_back()`: the ids of the tensors
    a gradient at the outputs comes back to
    (`gradient_paths.gradient_comes_back_from`); `holders`: the body's
    conds, loops and calls, each with the indices of its outputs as built.
    """
    readers = _readers_in_body(graph, body_ops, variables)
    # Outputs that depend on no x (constants, ints) get no gradient through.
    reached = gradient_paths.reached_from(
        list(sources) + [t for _, ops in readers for op in ops for t in op.outputs], body_ops)
    constants = _taken_as_constants(body_ops, holders, reached, coming_back)
    if gradient_reads.is_probe_graph(tf.compat.v1.get_default_graph()):
        # The planner's probe builds this gradient only to see what it reads,
        # and leaves the body's conds, loops and calls to the real gradient.
        # Differentiating one adds outputs to it in place (a loop's per-step
        # accumulators), which a second differentiation seeds with zeros:
        # a decorated Keras LSTM block then kept them all (108.6 MiB of
        # activations where 11.0 now), and one whose op without a gradient
        # another's gradient reads (tf.math.zeta's order) raised.
        constants += [t for op in holders for t in op.outputs]
    # A variable read by one of them (a kernel a cond taken as a constant
    # reads) gets no gradient through that read: stock, not asked for the
    # variable, never differentiates the cond.
    taken = {t.op for t in constants}
    readers = [(handle, [op for op in ops if op not in taken]) for handle, ops in readers]
    read_values = [t for _, ops in readers for op in ops for t in op.outputs]
    xs = list(sources) + read_values
    # A function call among them is differentiated even at a stop (by
    # SymbolicGradient, failing at run time): it is given no gradient instead.
    calls = list({t.op for t in constants if gradient_paths.is_function_call(t.op)})
    stops = list(sources) + [t for t in constants if t.op not in calls]
    with compat.gradients_overridden(calls, gradient_paths.NO_GRADIENT):
        grads = _source_and_read_gradients(graph, outputs, body_ops, reached, xs, stops,
                                           output_grads)
    grad_of = dict(zip(map(id, read_values), grads[len(sources):]))
    return grads[:len(sources)] + [_variable_gradient(handle, ops, grad_of)
                                   for handle, ops in readers]


def _source_and_read_gradients(graph, outputs, body_ops: list, reached: set, xs: list,
                               stops: list, output_grads: tuple) -> list:
    """The gradients of `xs` from the body's `outputs` given `output_grads`,
    stopping at `stops`: by our rewrite, or by TensorFlow where that cannot
    run (below)."""
    pairs = [(y, g) for y, g in zip(tf.nest.flatten(outputs), output_grads)
             if id(y) in reached and y.dtype.is_floating and g is not None]
    grads = [None] * len(xs)
    ys, grad_ys = [y for y, _ in pairs], [g for _, g in pairs]
    if pairs and tf.compat.v1.get_default_graph() is not graph:
        # The gradient is built in another graph than the body's: the backward
        # function of the tf.function the layer ran in (nested in the step, or
        # differentiated by an eager tape), or a cond or loop body taking the
        # gradient. The body's ops are copied there, reading the body's graph
        # through captures. (The planner's probe builds it so too, to see what
        # the stock gradient reads: it is not recomputed then.)
        probed = gradient_reads.is_probe_graph(tf.compat.v1.get_default_graph())
        recomputed = None if probed else backward_copies.recomputed_gradients(
            body_ops, reached, ys, xs, grad_ys, stops)
        if recomputed is not None:
            return recomputed
        if not probed:
            _log_once("@recompute_grad layers whose gradient is built in another graph "
                      "than the layer's (a layer called inside a nested tf.function, or "
                      "in a tf.function an eager GradientTape differentiates) and whose "
                      "call holds a cond, loop, function call or stateful op a gradient from its "
                      "outputs reaches (one behind tf.stop_gradient is kept) are "
                      "differentiated by TensorFlow there, without recomputation; call them "
                      "in the tf.function that takes the gradient")
        grads = compat.stock_gradients(ys, xs, grad_ys=grad_ys, stop_gradients=stops)
    elif pairs and compat.any_tape_recording():
        # A tape records this gradient (nested tapes: a higher order). Our
        # copies are made off the tape, so it would miss their part: the
        # body's own ops are differentiated, with TensorFlow's gradient.
        _log_once("a GradientTape records the gradient of @recompute_grad layers (nested "
                  "tapes: a higher order); those layers are differentiated without "
                  "recomputation there")
        grads = compat.stock_gradients(ys, xs, grad_ys=grad_ys, stop_gradients=stops)
    elif pairs:
        # Every op between the body's sources (and reads) and its outputs
        # was made by the call: the region is not sought above it.
        body = set(body_ops)
        grads = api.gradients_in_region(ys, xs, grad_ys, [y for y in ys if y.op in body], body,
                                        stop_gradients=stops)
    return grads


def _filled_in(grad, result: tf.Tensor) -> bool:
    """True if `grad`, the gradient of the layer's output `result`, is None
    or zeros TensorFlow made because nothing reads `result` differentiably.

    `tf.custom_gradient` hands its gradient function such zeros for unread
    outputs (tf.gradients: a `ZerosLike`; a tape: a zero constant, or a
    `Fill` of one for large shapes). Left out, a weight or input only they
    reach gets None, as without the decorator, so an optimizer skips it
    instead of applying a zero gradient (momentum and weight decay would
    still move the weight). Zeros for an output something differentiable
    reads are a real gradient (`tf.sign`'s is zeros): kept, as the
    undecorated layer's zeros. Readers passing no gradient on to it (a
    comparison, `tf.stop_gradient`, `tf.floor`, an op with no gradient
    registered) do not count (`gradient_paths.read_differentiably`).
    Read on the layer's own output: a copy the rewrite outside recomputes
    has the readers it copied. Dropping zeros changes no value.
    """
    if grad is None:
        return True
    return (isinstance(grad, tf.Tensor) and _zeros_filled_in(grad)
            and not gradient_paths.read_differentiably(result))


def _zeros_filled_in(grad: tf.Tensor) -> bool:
    """Whether `grad` is made as `tf.custom_gradient` fills in the gradient
    of an output no gradient reached."""
    op = grad.op
    if op.type == "ZerosLike":
        # Of the boundary's IdentityN output, or of a copy of it (in a backward
        # function of its own, of the placeholder capturing it): not the
        # planner's probe's stand-in for an output it does not read.
        return captures.captured_source(op.inputs[0]).op.type == "IdentityN"
    if op.type == "Fill":
        return _all_zeros(op.inputs[1])
    return op.type == "Const" and _all_zeros(grad)


def _all_zeros(tensor: tf.Tensor) -> bool:
    value = tf.get_static_value(tensor)
    return value is not None and not value.any()


def _after_weight_gradients(input_grads: list, weight_grads: list) -> list:
    """`input_grads`, made to exist only once every gradient in `weight_grads` does.

    The layer below recomputes its body as soon as its output gradient
    arrives. TensorFlow with one inter-op thread runs weight-gradient ops
    (MatMuls, Conv2DBackpropFilter) late, and they read this layer's
    recomputed tensors: without this wait every layer's recomputation would
    be alive together. A data dependency, so it holds under XLA too.
    """
    layer_gate = gradient_waits.gate([g for g in weight_grads if g is not None])
    if layer_gate is None:
        return input_grads
    return [_wait(g, layer_gate) for g in input_grads]


def _wait(gradient, layer_gate):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient_waits.wait_for_gate(gradient.values, layer_gate),
                                gradient.indices, gradient.dense_shape)
    return gradient_waits.wait_for_gate(gradient, layer_gate)


def _readers_in_body(graph, body_ops: list, variables: list) -> list:
    """(handle in the body's graph, the body's ops reading it) per variable,
    in one pass over the body."""
    handles = _local_handles(graph, variables)
    reading = {id(handle): [] for handle in handles if handle is not None}
    for op in body_ops:
        if op.outputs:
            for key in reading.keys() & {id(t) for t in op.inputs}:
                reading[key].append(op)
    return [(handle, reading[id(handle)] if handle is not None else []) for handle in handles]


def _through_reader_alone(op: tf.Operation, handle, grad_of: dict) -> list:
    """The gradient `op`'s own gradient function gives `handle`, from its
    outputs' gradients in `grad_of`: `op` alone, as tf.gradients runs it
    (zeros for its other differentiable outputs). Not tf.gradients from its
    outputs to the handle: that also walks paths through its other inputs
    (an earlier call of the layer feeding this one, a read of the variable
    in the body), whose parts their own readers give, and its stops do not
    stop at function calls."""
    try:
        gradient_function = compat.gradient_function(op)
    except LookupError:  # a v1 function call: differentiated as tf.gradients does
        gradient_function = None
    if gradient_function is None:
        reached = [t for t in op.outputs if grad_of.get(id(t)) is not None]
        return compat.stock_gradients(reached, [handle],
                                      grad_ys=[grad_of[id(t)] for t in reached])
    seeds = [grad_of.get(id(t)) for t in op.outputs]
    seeds = [compat.zeros_like_gradient(t)
             if g is None and compat.is_trainable(t) and t.dtype != tf.resource else g
             for g, t in zip(seeds, op.outputs)]
    with tf.name_scope(f"{op.name.split('/')[-1]}_grad"):
        grads = gradient_function(op, *seeds)
    grads = grads if isinstance(grads, (list, tuple)) else [grads]
    return [g for t, g in zip(op.inputs, grads) if t is handle and g is not None]


def _local_handles(graph, variables: list) -> list:
    """Each variable's handle as `graph` reads it (None where it does not)."""
    return [captures.local_tensor(graph, variable.handle) for variable in variables]


def _variable_gradient(handle, readers: list, grad_of: dict):
    """The sum of each reader's own gradient to `handle`, given its outputs' gradients.

    A plain read passes its output's gradient on (its registered gradient
    does nothing else); other readers, and a read given another gradient by
    a gradient_override_map, run their own gradient function
    (`_through_reader_alone`; a gather makes IndexedSlices). Not
    tf.gradients for a plain read: it walks every op downstream of the
    variable, the whole graph above the layer, so tracing n decorated
    layers took time quadratic in n. The parts add up as the rewrite's do
    (sparse if all are, whatever their index dtypes).
    """
    parts = []
    for op in readers:
        # .get: a loop reader gains outputs (its recorded chunk states) while
        # the body's gradients are built; those carry no gradient.
        reached = [t for t in op.outputs if grad_of.get(id(t)) is not None]
        if reached and op.type == "ReadVariableOp" and not compat.gradient_overridden(op):
            parts.append(tf.identity(grad_of[id(op.outputs[0])]))  # as tf.gradients' grad_ys
        elif reached:
            parts += _through_reader_alone(op, handle, grad_of)
    return ledger.add_up([part for part in parts if part is not None])
