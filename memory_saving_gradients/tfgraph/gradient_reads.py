"""Which forward tensors an op's registered gradient reads, asked of TensorFlow.

`tf.gradients` keeps a forward tensor alive until backprop only if a gradient
op reads it (ReLU's gradient reads its output, BiasAdd's reads nothing, MatMul's
reads both inputs). Rather than a hand-written table, each op type's
registered gradient is built once on a scratch graph, with placeholders of
the same dtypes and shapes standing for the op's inputs, outputs and output
gradients, and the placeholders the gradient ops consume are recorded, together with the peak
bytes of the intermediate tensors the gradient makes on the way to its
results (for `x * scale` with a per-channel scale: `dy * x`, as large as x,
before it is summed to the scale's gradient). Results are cached per op
type, attributes, dtypes and shapes.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import tensorflow as tf

from memory_saving_gradients.core import timeline
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import early_gradients
from memory_saving_gradients.tfgraph import gradient_linearity
from memory_saving_gradients.tfgraph import gradient_waits
from memory_saving_gradients.tfgraph import identity_folding
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import product_order
from memory_saving_gradients.tfgraph import sized_shapes
from memory_saving_gradients.tfgraph import static_values

logger = logging.getLogger(__name__)

# `_key(op) + (wanted,)` -> Reads, for the process (a probe builds a scratch graph).
_READS = {}


@dataclasses.dataclass(frozen=True)
class Reads:
    """What the op's gradient reads, by index of the op's inputs and outputs,
    and the peak bytes of its intermediate tensors (not its results);
    `captured`: names of other forward tensors it reads (a tf.custom_gradient
    closing over the tensors of its call); `ungraded`: indices of the inputs
    it makes no gradient for (None); `early_bytes`: bytes of its parts that
    read only forward tensors, which run in the forward pass (early_gradients);
    `passed`: (input index, output index) of each input whose gradient is
    that output's gradient itself, no buffer of its own (BiasAdd's, and an
    AddV2's where TensorFlow knows no reduction is needed); `forwards`:
    (input index, candidates) for each input whose gradient an element-wise
    kernel makes, which may write it over a candidate it reads last:
    ("grad", output index), that output's gradient, or ("input", index) /
    ("output", index), a forward tensor (`_forward_candidates`);
    `scratch_forwards`: (stand-in, bytes) pairs, the stand-ins named as in
    `forwards`: the scratch is that much less where the stand-in's buffer dies
    with the gradient, as an intermediate is written over it
    (`_scratch_forwards`). Both as the rewrite orders the gradient's ops
    (`product_order`); `stock_forwards` and `stock_scratch_forwards` as
    stock tf.gradients leaves them, where that differs (else None).
    `linear`: whether the gradient is linear in the incoming gradients
    (`gradient_linearity`; registered gradients are)."""
    inputs: tuple
    outputs: tuple
    scratch_bytes: int = 0
    captured: tuple = ()
    ungraded: tuple = ()
    early_bytes: int = 0
    passed: tuple = ()
    forwards: tuple = ()
    scratch_forwards: tuple = ()
    stock_forwards: tuple = None
    stock_scratch_forwards: tuple = None
    linear: bool = True


def gradient_reads(op: tf.Operation, wanted: tuple = None, folds: bool = None) -> Reads:
    """The `Reads` of `op`'s registered gradient (cached per kind of op).

    `wanted`: one bool per input, whether backprop needs its gradient (None:
    all). Gradient ops that lead only to unwanted results (the gradient of
    `x * 0.5` for the constant) are pruned when the step runs, so their reads
    and scratch do not count. Ops without a gradient read nothing; ops whose
    gradient cannot be built on a scratch graph (function calls, control
    flow, unusual attributes) are assumed to read every input and output,
    which never under-counts memory. `folds`: whether Grappler folds the
    products by one of `op`'s graph into identities
    (`identity_folding.folds_to_identities`, asked when None; a reading of
    many ops asks once).
    """
    wanted = tuple(wanted) if wanted is not None else (True,) * len(op.inputs)
    folds = identity_folding.folds_to_identities(op.graph) if folds is None else folds
    key = _key(op) + (wanted, folds)
    if key not in _READS:
        _READS[key] = _reads(op, wanted, folds)
    return _READS[key]


# Arguments whose value chooses axes (reduced, gathered, tiled, permuted): the
# gradient's shapes and its kernels' temporaries follow from it, so the probe's
# stand-in takes it (`_axis_values`). Positions (begin, indices) change neither.
_AXIS_ARGUMENTS = frozenset({"axis", "reduction_indices", "multiples", "perm"})


def _key(op):
    attrs = tuple(sorted((name, value.SerializeToString(deterministic=True))
                         for name, value in op.node_def.attr.items()
                         # Private attrs do not change the gradient, except the
                         # one naming a tf.custom_gradient's own gradient function.
                         if not name.startswith("_") or name == "_gradient_op_type"))
    # Sizes as the probe's stand-ins take them: unknown ones as assumed in op's graph.
    signature = tuple(
        (t.dtype.name, _dims(t.shape), _dims(tf.TensorShape(sized_shapes.sized_dims(t))))
        for t in (*op.inputs, *op.outputs))
    values = tuple(None if v is None else v.tobytes() for v in _axis_values(op))
    return op.type, attrs, signature, values, _read_outputs(op)


def _dims(shape):
    """A shape as a key: its dimensions (None for unknown ones), None for an unknown rank."""
    return None if shape.rank is None else tuple(shape.as_list())


def _read_outputs(op):
    """Which outputs are read: only those receive a gradient (others get zeros,
    and some gradients skip work for zero seeds, e.g. the softmax cross
    entropy's second-order term)."""
    return tuple(bool(t.consumers()) for t in op.outputs)


def _reads(op, wanted, folds):
    """The Reads of `op`'s registered gradient, probed (two threads tracing at
    once may both probe one kind: the same answer, stored twice)."""
    reads = _probed(op, wanted, folds)
    # A function's gradient (a call's, a loop body's) differentiates its body,
    # overrides included. Our own overrides are linear by construction.
    linear = gradient_linearity.declared_linear(op) or (
        reads.linear and not gradient_linearity.calls_nonlinear_gradients(
            op, lambda inner: gradient_reads(inner).linear))
    return reads if linear == reads.linear else dataclasses.replace(reads, linear=linear)


def _probed(op, wanted, folds):
    """`_reads` but for the functions `op` calls."""
    everything = Reads(tuple(range(len(op.inputs))), tuple(range(len(op.outputs))))
    if op.type in loops.LOOP_OP_TYPES:
        # while_v2's gradient reads the loop's stacks (its accumulator outputs,
        # the `core.model.Loop`'s own buffers), its iteration count and its
        # inputs (loop invariants; a chunked rerun starts from all of them),
        # never the values the loop computed.
        return Reads(tuple(range(len(op.inputs))), (0,))
    try:
        grad_fn = compat.gradient_function(op)
    except LookupError:
        return everything  # tf.gradients would raise; never planned around
    if grad_fn is None:
        return Reads((), ())
    try:
        try:
            return _probe(op, grad_fn, wanted, folds, sized=True)
        except (ValueError, TypeError):  # unknown dimensions sized as they cannot be
            # (a custom gradient's captures may have them where the op has none)
            if not _overridden(op) and all(t.shape.is_fully_defined()
                                           for t in (*op.inputs, *op.outputs)):
                raise
            return _probe(op, grad_fn, wanted, folds, sized=False)
    except Exception as error:  # pylint: disable=broad-except  # any failure: assume the worst
        logger.debug("gradient of %s (%s) not probed, taken to read everything: %s",
                     op.name, op.type, error)
        return dataclasses.replace(everything, linear=not _overridden(op))


# The scratch graphs gradients are built in to be looked at, never run.
_probe_graphs = weakref.WeakSet()


def is_probe_graph(graph: tf.Graph) -> bool:
    """True for a graph this module builds a gradient in only to see what it
    reads (a custom gradient called there need not say how it would run)."""
    return graph in _probe_graphs


def _overridden(op):
    """Whether `op`'s gradient is an override, not its type's registered one."""
    return loops.CUSTOM_GRADIENT_ATTR in op.node_def.attr


def _probe(op, grad_fn, wanted, folds, sized):
    """Builds `grad_fn` for a copy of `op` on a scratch graph; returns the Reads of
    the gradient ops that lead to the `wanted` inputs' gradients.

    `sized`: stand-ins take unknown dimensions as the planner assumes them
    (`sized_shapes`), so the probe's shapes, sizes and forwarding are those
    the planner assumes (an unknown batch); where such shapes do not
    fit together (a reshape of an unknown dimension into two), the caller
    probes with the dimensions left unknown."""
    # A tf.custom_gradient's gradient ignores the op and reads the forward
    # tensors its closure holds: built where it may capture them, it shows them.
    custom = _overridden(op)
    scratch = (compat.capturing_graph(op.graph, "gradient_probe",
                                      sized_shapes.sized_dims if sized else None)
               if custom else tf.Graph())
    _probe_graphs.add(scratch)
    with scratch.as_default():
        inputs = [_stand_in(t, f"input{i}", sized, value)
                  for i, (t, value) in enumerate(zip(op.inputs, _axis_values(op)))]
        copy = compat.create_op_copy(scratch, op, inputs, keep_shapes=True)
        seeds = [None if t.dtype.base_dtype in op_kinds.OPAQUE_DTYPES
                 else _stand_in(old, f"grad{i}", sized) if read else _zeros(t)
                 for i, (t, old, read) in enumerate(zip(copy.outputs, op.outputs,
                                                        _read_outputs(op)))]
        first_new = len(scratch.get_operations())
        results = grad_fn(copy, *seeds)
        results = results if isinstance(results, (list, tuple)) else [results]
        ungraded = tuple(i for i, r in enumerate(results) if r is None)
        given = {id(s): j for j, (s, read) in enumerate(zip(seeds, _read_outputs(op)))
                 if read and s is not None}
        passed = tuple((i, given[id(seed)]) for i, seed in
                       ((i, _seed_of(r, given)) for i, r in enumerate(results)) if seed is not None)
        stands_for = {id(t): ("input", k) for k, t in enumerate(inputs)}
        stands_for.update((id(t), ("output", k)) for k, t in enumerate(copy.outputs))
        stands_for.update((i, ("grad", j)) for i, j in given.items())
        all_results = results
        results = [r for r, keep in zip(results, wanted) if keep]
        new_ops = _leading_to(scratch.get_operations()[first_new:], results)
        read = {id(t) for new_op in new_ops
                if new_op.type not in op_kinds.SHAPE_ONLY_OP_TYPES for t in new_op.inputs}
        result_ids = {id(r) for r in results if r is not None}
        pairs = compat.captured_pairs(scratch) if custom else ()
        outer_of = {id(inner): outer for outer, inner in pairs}
        value_of = _value_of(folds, outer_of)
        scratch_bytes = _intermediate_peak(new_ops, result_ids, value_of=value_of)
        # Before `sums_first` below adds its edges: early parts are those
        # that wait for no seed in the gradient as tf.gradients builds it.
        early = early_gradients.early_bytes(new_ops, seeds, value_of)

        def forwarding():
            return (tuple((i, found) for i, found in (
                (i, _forward_candidates(r, stands_for, new_ops))
                for i, r in enumerate(all_results)
                if i < len(wanted) and wanted[i] and i not in dict(passed)) if found),
                _scratch_forwards(new_ops, result_ids, stands_for, scratch_bytes, value_of))
        stock = forwarding()
        # The rewrite makes a broadcast product's sibling wait for its sum:
        # the sibling then reads the incoming gradient last.
        ordered = (forwarding() if product_order.sums_first(
            new_ops, [r for r in results if r is not None]) else stock)
        stock_if_other = (None, None) if stock == ordered else stock
        # Of every result, wanted or not: a second order may differentiate any input.
        linear = not custom or gradient_linearity.is_linear(
            _leading_to(scratch.get_operations()[first_new:], all_results), seeds, all_results)
    # An eager capture (a variable's handle made outside any function) is no activation.
    captured = [outer for outer, inner in pairs
                if id(inner) in read and not compat.is_eager_tensor(outer)]
    return Reads(tuple(i for i, t in enumerate(inputs) if id(t) in read
                       or any(c is op.inputs[i] for c in captured)),
                 tuple(i for i, t in enumerate(copy.outputs) if id(t) in read
                       or any(c is op.outputs[i] for c in captured)),
                 scratch_bytes,
                 tuple(c.name for c in captured
                       if not any(c is t for t in list(op.inputs) + list(op.outputs))),
                 ungraded, early, passed, *ordered, *stock_if_other, linear)


def _seed_of(result, seeds):
    """The seed (`seeds`: ids) that `result` is, or is an alias of (a reshape of it); None."""
    while isinstance(result, tf.Tensor):
        if id(result) in seeds:
            return result
        if result.op.type not in timeline.ALIASING_OP_TYPES or not result.op.inputs:
            return None
        result = result.op.inputs[0]
    return None


def _forward_candidates(result, stands_for, ops):
    """What the kernel making `result` (through reshapes) may write it over,
    among the probe's stand-ins (`stands_for`: id -> ("grad" | "input" |
    "output", index)), in the order the kernel tries them; () if none.

    Only stand-ins the kernel surely reads last (every other reader among
    `ops`, the gradient's ops, runs before it): stock tf.gradients leaves
    `dy * s` and `dy * a` unordered, and the first to run finds `dy` held.
    None where it may take an intermediate it reads last instead: the probe
    counts that intermediate as the result (`_intermediate_peak`)."""
    while isinstance(result, tf.Tensor) and result.op.type in timeline.ALIASING_OP_TYPES:
        result = result.op.inputs[0] if result.op.inputs else None
    if not isinstance(result, tf.Tensor) or result.op not in ops:
        return ()
    kernel = result.op
    before = gradient_waits.waits_for(ops, kernel)
    candidates = [t for out, inputs in op_kinds.forwardable_inputs(kernel) if out is result
                  for t in inputs if _read_last_by(kernel, t, ops, before)]
    if any(id(t) not in stands_for for t in candidates):
        return ()
    return tuple(stands_for[id(t)] for t in candidates)


def _read_last_by(kernel, tensor, ops, before):
    """Whether every reader of `tensor` among `ops` but `kernel` is in
    `before` (ops `kernel` waits for), so `kernel` reads it last."""
    return all(reader is kernel or reader in before
               for reader in tensor.consumers() if reader in ops)


def _scratch_forwards(ops, results, stands_for, scratch, value_of):
    """(stand-in, bytes saved) for each stand-in (`stands_for`) that an
    intermediate of `ops` (not a result) may be written over: `scratch` less
    the intermediate peak where that stand-in's buffer is the ops' to write
    over (SquaredDifference's gradient writes `x - y` over a recomputed `x`
    that dies there, which the probe, holding its stand-ins elsewhere, counts
    as a buffer of its own). `value_of` as in `_intermediate_peak`."""
    found, seen = [], set()
    for op in ops:
        for out, inputs in op_kinds.forwardable_inputs(op):
            if id(out) in results:
                continue
            for t in inputs:
                if id(t) not in stands_for or id(t) in seen:
                    continue
                seen.add(id(t))
                # Only where `op` surely reads it last (as `_forward_candidates`).
                if not _read_last_by(op, t, ops, gradient_waits.waits_for(ops, op)):
                    continue
                saved = scratch - _intermediate_peak(ops, results, writable=t,
                                                     value_of=value_of)
                if saved > 0:
                    found.append((stands_for[id(t)], saved))
    return tuple(found)


def _value_of(folds, outer_of):
    """For `early_gradients.early_bytes`: a probe tensor's static value (that
    of the tensor it stands for, `outer_of`: id -> outer tensor), where
    Grappler folds the graph's constants (`folds`); elsewhere none is used."""
    if not folds:
        return lambda t: None
    return lambda t: tf.get_static_value(outer_of.get(id(t), t))


def _leading_to(ops, results):
    """The ops among `ops` (creation order, kept) that some of `results` depend on."""
    tensors = [part for r in results if r is not None
               for part in ((r,) if hasattr(r, "op") else (r.values, r.indices))]
    needed = gradient_waits.ancestors_among(ops, tensors)
    return [op for op in ops if op in needed]


def _intermediate_peak(ops, results, writable=None, value_of=lambda t: None):
    """Peak bytes `ops` (in creation order) hold beyond the results they make.

    The timeline allocates the results beside this scratch, so a buffer that
    becomes a result (an element-wise result written over the intermediate
    it reads last, the reshape of a sum) counts once, as a result: the peak
    is taken over intermediates and results alike, less the results' bytes.
    Each buffer lives from its op to the last reader among `ops` of the
    tensors sharing it; shapes are static (the stand-ins have the op's
    shapes; `op_kinds.tensor_bytes`). A reduction's kernel temporary
    (`op_kinds.reduction_temp_bytes`) counts while it runs. `writable`: a
    stand-in whose buffer the ops may write over after their last read of it
    (counted elsewhere: what is written there costs nothing here).
    `value_of(t)`: `t`'s value where Grappler folds it (`_value_of`), for the
    products by one it makes identities (`early_gradients.folds_to_identity`).
    """
    last_reader = {}
    for step, op in enumerate(ops):
        for t in op.inputs:
            last_reader[id(t)] = step
    buffers = _buffers(ops, last_reader, writable, value_of)
    starts, frees, result_bytes = {}, {}, 0
    for start, size, tensors in buffers:
        starts[start] = starts.get(start, 0) + size
        if tensors & results:
            result_bytes += size
        else:
            end = max(last_reader.get(t, start) for t in tensors)
            frees[end] = frees.get(end, 0) + size
    alive, peak = 0, 0
    for step, op in enumerate(ops):
        alive += starts.get(step, 0)
        # The probe's graph is ours to evaluate: a tile's gradient computes its sum's axes.
        peak = max(peak, alive + op_kinds.reduction_temp_bytes(op, tf.get_static_value))
        alive -= frees.get(step, 0)
    return max(peak - result_bytes, 0)


def _buffers(ops, last_reader, writable=None, value_of=lambda t: None):
    """(first step, bytes, ids of the tensors sharing it) of each buffer `ops`
    allocate: an output shares a buffer where `_shared_source` says so (a
    stand-in's at no bytes), and so does an element-wise op's whose
    same-sized intermediate input (or `writable`) dies there
    (`_forwarded_input`); `writable`'s buffer is listed first, at no bytes.
    A placeholder among `ops` is a custom gradient's capture of a forward
    tensor: held elsewhere, at no bytes, never written over."""
    buffer_of, buffers = {}, []
    if writable is not None:
        buffers.append((-1, 0, {id(writable)}))
        buffer_of[id(writable)] = 0
    outside = set()  # stand-ins' buffers: counted and freed elsewhere, never written over

    def held_elsewhere(tensor, step):
        buffers.append((step, 0, {id(tensor)}))
        buffer_of[id(tensor)] = len(buffers) - 1
        outside.add(len(buffers) - 1)

    for step, op in enumerate(ops):
        if op.type == "Placeholder":  # a custom gradient's capture: a forward tensor
            held_elsewhere(op.outputs[0], step)
            continue
        shared = None
        source = _shared_source(op, value_of)
        if source is not None:
            if id(source) not in buffer_of:
                held_elsewhere(source, step)
            shared = buffer_of[id(source)]
        else:
            forwarded = _forwarded_input(op, buffers, buffer_of, outside, last_reader, step)
            if forwarded is not None:
                shared = buffer_of[id(forwarded)]
        for t in op.outputs:
            if t.dtype.base_dtype in op_kinds.OPAQUE_DTYPES:
                continue
            if shared is None:
                buffers.append((step, op_kinds.tensor_bytes(t), set()))
                buffer_of[id(t)] = len(buffers) - 1
            else:
                buffer_of[id(t)] = shared
            buffers[buffer_of[id(t)]][2].add(id(t))
    return buffers


def _shared_source(op, value_of):
    """The tensor whose buffer `op`'s output is, unwritten, or None: an
    aliasing op's input, or the x of an `x * 1` Grappler folds into an
    Identity (`value_of`; silu's `beta * features`: measured, EfficientNetB0's
    recomputed swish gradients held two buffers beside their input and
    output, not three)."""
    if op.type in timeline.ALIASING_OP_TYPES and op.inputs:
        return op.inputs[0]
    return early_gradients.folds_to_identity(op.outputs[0], value_of) if op.outputs else None


def _forwarded_input(op, buffers, buffer_of, outside, last_reader, step):
    """The input whose buffer `op` writes its (one) output into, or None: a
    forwardable one (`op_kinds.forwardable_inputs`) made among the ops (its
    buffer not one of `outside`) whose buffer `op` reads last, through every
    tensor sharing it (`buffers`, as `_buffers` builds them: an alias read
    later keeps it)."""
    if len(op.outputs) != 1:
        return None
    return next((t for _, inputs in op_kinds.forwardable_inputs(op) for t in inputs
                 if id(t) in buffer_of and buffer_of[id(t)] not in outside
                 and max(last_reader.get(shared, -1)
                         for shared in buffers[buffer_of[id(t)]][2]) == step), None)


def _zeros(tensor):
    """A seed tf.gradients' zero tests recognise (a constant, or ZerosLike)."""
    if tensor.shape.is_fully_defined():
        return tf.zeros(tensor.shape, tensor.dtype)
    return tf.zeros_like(_stand_in(tensor, "unread", sized=False))


def _stand_in(tensor, name, sized, value=None):
    """A placeholder of `tensor`'s dtype and shape (`sized`: unknown dimensions
    as the planner assumes them), or a constant of `value`."""
    if value is not None:
        return tf.constant(value, tensor.dtype.base_dtype, name=name)
    shape = sized_shapes.sized_dims(tensor) if sized else tensor.shape
    return tf.compat.v1.placeholder(tensor.dtype.base_dtype, shape, name=name)


def _axis_values(op):
    """Per input of `op`: its value where it is an `_AXIS_ARGUMENTS` argument
    given by a constant (`static_values.const_value`), else None."""
    values = [None] * len(op.inputs)
    constant = [i for i, t in enumerate(op.inputs) if t.op.type == "Const"]
    names = _argument_names(op) if constant else None
    for i in constant if names is not None else ():
        if names[i] in _AXIS_ARGUMENTS:
            values[i] = static_values.const_value(op.inputs[i])
    return values


def _argument_names(op):
    """The op definition's argument name of each input of `op` (a list argument
    names each of its inputs), or None where they do not line up."""
    names = []
    for arg in op.op_def.input_arg:
        count = (op.get_attr(arg.number_attr) if arg.number_attr
                 else len(op.get_attr(arg.type_list_attr)) if arg.type_list_attr else 1)
        names += [arg.name] * count
    return names if len(names) == len(op.inputs) else None
