"""Reading a TensorFlow graph into the core's model, once per `gradients` call.

The ops between xs and ys become a `core.model.GraphModel` of activations
(region tensors that carry per-example data). Only this module and the
rewrite see TensorFlow objects; what the rewrite alone needs (which tensors
lie in the region, what each op's gradient reaches) stays here, in `Reading`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, NamedTuple, Optional, Sequence

import networkx as nx
import tensorflow as tf

from memory_saving_gradients.core import collector
from memory_saving_gradients.core import forward_order
from memory_saving_gradients.core import stock_order
from memory_saving_gradients.core import timeline
from memory_saving_gradients.core.model import Activation
from memory_saving_gradients.core.model import GraphModel
from memory_saving_gradients.core.model import WeightSum
from memory_saving_gradients.tfgraph import broadcast_sinking
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import gradient_order
from memory_saving_gradients.tfgraph import gradient_reads
from memory_saving_gradients.tfgraph import graph_cache
from memory_saving_gradients.tfgraph import graph_walks
from memory_saving_gradients.tfgraph import duplicate_ops
from memory_saving_gradients.tfgraph import identity_folding
from memory_saving_gradients.tfgraph import loop_memory
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import sized_shapes
from memory_saving_gradients.tfgraph import conv_gradients
from memory_saving_gradients.tfgraph import grouped_conv_calls
from memory_saving_gradients.tfgraph import transposed_copies
from memory_saving_gradients.tfgraph import workspace

# Ops whose output is their first input's buffer, passed on: `_made_outside`
# walks back through them to the op that made a buffer.
_PASS_THROUGH_OP_TYPES = timeline.ALIASING_OP_TYPES | {
    "EnsureShape", "CheckNumerics", "CheckNumericsV2", "Switch", "RefSwitch", "Enter", "RefEnter"}
# Gathers of rows: the gradient of the table (input 0) is an IndexedSlices.
_ROW_GATHER_OP_TYPES = frozenset({"GatherV2", "Gather"})
# Gathers from a variable's handle, the only ops with a gradient for it.
_HANDLE_GATHER_OP_TYPES = frozenset({"ResourceGather", "ResourceGatherNd"})
# Sources of the back edges of tf.compat.v1 while loops.
_BACK_EDGE_OP_TYPES = frozenset({"NextIteration", "RefNextIteration"})


@dataclasses.dataclass(frozen=True)
class Reading:
    """The core's model of a region, with what only the rewrite needs beside it.

    Attributes:
      model: the activations, for the core.
      region: names of the tensors produced between xs and ys (not those
        inside a tf.compat.v1 while loop, see `unit_inputs`).
      op_inputs: op name -> names of the tensors its gradient reaches: its
        inputs, or for the Exit ops of a tf.compat.v1 while loop, the tensors
        entering the loop.
      ops: every op between xs and ys (`region_ops`), loop bodies included.
      gated: whether the rewrite orders the region's gradient ops (level
        gates, chained gradients, product_order). Not across tf.compat.v1
        control flow: there a gradient may be dead (an untaken cond branch),
        and a gate reading it would kill every copy; there the rewrite builds
        what stock does.
    """
    model: GraphModel
    region: frozenset
    op_inputs: Mapping[str, tuple]
    ops: tuple
    gated: bool

    def is_weight(self, name: str) -> bool:
        """True for region tensors that depend only on xs (kept, never recomputed)."""
        return name in self.region and name not in self.model.tensors


class DataTensors:
    """Names of the tensors of a graph that carry per-example data.

    Those are the tensors a data input reaches through ops, not counting
    resource tensors (variable handles). Variants count: a TensorList made
    from the input (as Keras' RNNs feed a loop) carries its data. Found by a
    forward search from the data inputs, linear in the graph size; searching
    forward (not memoising a backward walk) stays correct on tf.compat.v1
    while loops, whose NextIteration -> Merge back edges make the graph cyclic.
    Kept up to date by `graph_cache` as ops are added.
    """

    def __init__(self, graph: tf.Graph):
        self.names = set()
        self.add_ops(graph.get_operations())

    def add_ops(self, ops: list) -> None:
        stack = [op for op in ops if op.type in op_kinds.DATA_SOURCE_OP_TYPES
                 or any(i.name in self.names for i in op.inputs)]
        while stack:
            for t in stack.pop().outputs:
                if t.name not in self.names and t.dtype.base_dtype != tf.resource:
                    self.names.add(t.name)
                    stack.extend(t.consumers())


def region_ops(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
               bound: Optional[set] = None) -> list:
    """Ops that depend on some x and that some y depends on, in topological order;
    only ops in `bound` when given (the caller knows the region lies in it).

    Linear in the size of the graph (of `bound`, when given).
    """
    reached = graph_walks.ops_reading(xs, within=bound)
    between = set()
    stack = [y.op for y in ys]
    while stack:
        op = stack.pop()
        if op in reached and op not in between:
            between.add(op)
            stack.extend(i.op for i in op.inputs)
    return topological_order(between)


def topological_order(ops: set) -> list:
    """`ops` ordered so that each comes after the ops among them it reads.

    Creation order almost is one, but not in tf.compat.v1 conds: an op in a
    branch is made before the Switch that feeds it. So a depth-first search
    over data edges puts inputs first, visiting ops in creation order (which
    it keeps where it is topological already). The back edges of
    tf.compat.v1 while loops (NextIteration -> Merge) are not followed.
    Linear in the number of ops and edges.
    """
    done = set()
    order = []
    for root in sorted(ops, key=compat.creation_id):
        stack = [(root, False)]
        while stack:
            op, inputs_done = stack.pop()
            if inputs_done:
                order.append(op)
            elif op not in done:
                done.add(op)
                stack.append((op, True))
                stack.extend((i.op, False) for i in reversed(op.inputs)
                             if i.op in ops and i.op not in done
                             and i.op.type not in _BACK_EDGE_OP_TYPES)
    return order


def unit_inputs(ops: Sequence[tf.Operation]) -> dict:
    """Op -> the tensors it reads, with each tf.compat.v1 while loop as one unit.

    Tensors inside a v1 while loop exist once per iteration: tf.gradients can
    neither seed nor stop at them from outside the loop. So the ops inside a
    loop are left out, and each of the loop's Exit ops reads every tensor that
    enters the loop. Other ops (v2 While is one op already) read their inputs.
    """
    inputs = {}
    entering = {}  # loop -> tensors that enter it, in order
    for op in ops:
        loop = op_kinds.outermost_while_loop(op)
        if loop is None:
            inputs[op] = list(op.inputs)
            continue
        outside = entering.setdefault(loop, {})
        outside.update((i.name, i) for i in op.inputs
                       if op_kinds.outermost_while_loop(i.op) is not loop)
    for op in ops:
        # Exit ops belong to their loop's context, and are its only outputs.
        if op.type in ("Exit", "RefExit"):
            inputs[op] = list(entering[op_kinds.outermost_while_loop(op)].values())
    return inputs


def _activations(units, inputs, in_region, data):
    """Names of the unit outputs that carry per-example data."""
    activations = set()
    for op in units:
        if any(i.name in activations or (i.op not in in_region and i.name in data)
               for i in inputs[op]):
            activations.update(o.name for o in op.outputs)
    if not activations:
        # No per-example input (e.g. data baked into constants): treat every
        # region tensor as an activation except the reads of the xs themselves.
        activations = {o.name for op in units if not all(
            i.op not in in_region for i in inputs[op]) for o in op.outputs}
    return activations


@collector.paused
def build_model(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
                bound: Optional[set] = None) -> Reading:
    """Read the region between `xs` and `ys` (lists of tensors) into a Reading;
    `bound`: a set of ops the region lies in, if the caller knows one."""
    ops = region_ops(ys, xs, bound)
    inputs = unit_inputs(ops)
    units = [op for op in ops if op in inputs]
    data = graph_cache.per_graph(ys[0].graph, DataTensors).names
    activations = _activations(units, inputs, set(ops), data)
    rerunnable = loops.rerunnable_loops(units)
    x_names = {x.name for x in xs}
    tensors, pinned, op_outputs, op_inputs, edges = {}, set(), {}, {}, []
    other_bytes, weights_first = 0, set()
    weight_parts = {}  # weight -> [(op, `_WeightPart`)]
    region = frozenset(o.name for op in units for o in op.outputs)
    differentiated = region | x_names
    regions = (differentiated - activations, differentiated, data, x_names)
    # Asked once each: each ask reads the config (and the environment, the CPU affinity).
    folds = identity_folding.folds_to_identities(ys[0].graph)
    concurrent = workspace.several_inter_op_threads()
    gated = not any(op.type in op_kinds.V1_CONTROL_FLOW_OP_TYPES for op in units)
    backprop = {"grad_reads": {}, "workspace": {}, "weight_grad_bytes": {},
                "stock_workspace": {}, "run_workspace": {}, "recompute_workspace": {},
                "trailing_workspace": {}, "ungraded": {}, "shared_buffers": {},
                "early_workspace": {}, "small_grads": {}, "passed_grads": {},
                "forwarding": {}, "forwarded_grads": {}, "workspace_forwards": {},
                "stock_forwarded_grads": {}, "stock_workspace_forwards": {},
                "outside_reads": {}, "outside_bytes": {},
                "merged": duplicate_ops.merged_outputs(ops, activations)}
    for op in units:
        name = op.name
        op_inputs[name] = tuple(i.name for i in inputs[op])
        outs = {o.name: o for o in op.outputs}  # names asked once: each ask calls into TF
        if activations.isdisjoint(outs):
            other_bytes += sum(op_kinds.tensor_bytes(o) for o in outs.values())
            continue
        linear, parts = _record_backprop(
            op, inputs[op], activations, regions, (folds, gated, concurrent), backprop)
        for part in parts:
            weight_parts.setdefault(part.weight, []).append((name, part))
        backprop["run_workspace"][name] = workspace.run_workspace_bytes(op)
        if (gated and backprop["weight_grad_bytes"][name] and op.inputs[0].name in activations
                and gradient_order.weight_gradient_first(op)):
            weights_first.add(name)
        if transposed_copies.recomputes_scratch_free(op):
            backprop["recompute_workspace"][name] = transposed_copies.copy_workspace_bytes(op)
        # An x's own op is differentiated as it is: the gradients below it
        # must read the x itself, or a gradient of them (second order) would
        # miss their dependence on that x. An op whose gradient is not linear
        # in the incoming one is too: a second order through ours meets its
        # original and its copy, and would give f(a) + f(b) for f(a + b).
        recomputable = (op_kinds.is_recomputable(op, rerunnable) and x_names.isdisjoint(outs)
                        and linear)
        cost = (loop_memory.loop_cost(op) if op.type in loops.LOOP_OP_TYPES
                else op_kinds.op_cost(op))
        op_outputs[name] = tuple(n for n in outs if n in activations)
        backprop["shared_buffers"].update(_passed_through(op, activations))
        forwarded = tuple((out.name, names) for out, names in (
            (out, tuple(t.name for t in inputs if t.name in activations))
            for out, inputs in op_kinds.forwardable_inputs(op)) if names and out.name in activations)
        if forwarded:
            backprop["forwarding"][name] = forwarded
        act_inputs = [n for n in op_inputs[name] if n in activations]
        for n in op_outputs[name]:
            o = outs[n]
            tensors[n] = Activation(
                name=n, op=name, op_type=op.type, bytes=loop_memory.list_bytes(o),
                cost=cost, recomputable=recomputable,
                is_float=o.dtype.is_floating or loop_memory.is_float_list(o))
            edges.extend((i, n) for i in act_inputs)
        if not recomputable:
            pinned.update(op_outputs[name])
            pinned.update(act_inputs)
        pinned.update(x_names.intersection(op_outputs[name]))
    # Whole ops: tf.gradients stops at ops, so a kept output's recomputed
    # sibling would lose its gradient.
    pinned = {o for n in pinned for o in op_outputs[tensors[n].op]}
    loop_facts = {op.name: loop_memory.loop_facts(op, op in rerunnable, activations, x_names)
                  for op in units
                  if op.type in loops.LOOP_OP_TYPES and op.name in op_outputs}
    graph = nx.DiGraph()
    graph.add_nodes_from(tensors)  # in order, then the edges in order: as added op by op
    graph.add_edges_from(edges)
    ys_read = tuple(y.name for y in ys if y.name in activations)
    model = GraphModel(
        graph=graph, tensors=tensors, pinned=frozenset(pinned),
        unsized=_unsized(units, tensors), unknown_dim_size=sized_shapes.assumed_size(),
        order=tuple(tensors), ys=ys_read,
        forward_order=forward_order.freeing_ops_sooner(
            tuple(tensors), graph, {n: t.op for n, t in tensors.items()},
            {n: t.bytes for n, t in tensors.items()}, ys_read),
        op_outputs=op_outputs, other_bytes=other_bytes, num_region_ops=len(ops),
        loops=loop_facts, weights_first=frozenset(weights_first),
        weight_sums=_weight_sums(weight_parts, gated),
        deferred_weight_gradient_types=_deferred_weight_gradient_types(units, concurrent),
        **backprop)
    return Reading(model=model, region=region, op_inputs=op_inputs, ops=tuple(ops), gated=gated)


def _unsized(units, tensors) -> dict:
    """`GraphModel.unsized`: activation name -> shape text, for activations
    whose static shape leaves a dimension unknown (not its rank: opaque
    buffers, a fused batch norm's reserve space, count as one element)."""
    return {o.name: str(o.shape) for op in units for o in op.outputs
            if o.name in tensors and o.shape.rank is not None
            and not o.shape.is_fully_defined()}


def _deferred_weight_gradient_types(units, concurrent) -> frozenset:
    """`GraphModel.deferred_weight_gradient_types`: with one inter-op thread, no XLA
    (which schedules the step itself) and TensorFlow's own convolution kernels
    (`workspace.stock_kernels_take_scratch`; oneDNN's rewrite lists the
    gradients the other way), `stock_order.WEIGHTS_LISTED_FIRST`."""
    listed_first = stock_order.WEIGHTS_LISTED_FIRST
    if (concurrent or not units or compat.in_xla_context(units[0].graph)
            or not any(op.type in listed_first for op in units)
            or not workspace.stock_kernels_take_scratch()):
        return frozenset()
    return listed_first


def _passed_through(op, activations) -> dict:
    """Output -> the input whose buffer it is, of an op that passes each input
    through as the output of the same index (a tf.custom_gradient's IdentityN),
    or that slices its input along the first axis as views
    (`op_kinds.first_axis_view_of`: an RNN's `x[t]`, `tf.unstack`)."""
    if op.type == "IdentityN":
        pairs = zip(op.inputs, op.outputs)
    else:
        viewed = op_kinds.first_axis_view_of(op)
        pairs = [] if viewed is None else [(viewed, o) for o in op.outputs]
    return {o.name: i.name for i, o in pairs if o.name in activations and i.name in activations}


def _named_stand_in(op, kind, index, activations):
    """A probe's stand-in (`gradient_reads.Reads.forwards`) as the model names
    it: ("grad", output) or ("value", activation); None if not an activation's."""
    tensors = op.outputs if kind in ("grad", "output") else op.inputs
    name = tensors[index].name if index < len(tensors) else None
    return (("grad" if kind == "grad" else "value"), name) if name in activations else None


def _record_forwarding(op, reads, activations, backprop, gated):
    """The buffers `op`'s gradient may write over (`GraphModel.forwarded_grads`,
    `workspace_forwards`), and the same under stock's order where that differs
    (the `stock_` fields). Where the rewrite orders nothing (`Reading.gated`
    false), it builds what stock does: stock's are the only ones."""
    planned = (reads.forwards, reads.scratch_forwards)
    stock = (reads.stock_forwards, reads.stock_scratch_forwards)  # Nones: as planned
    if not gated and stock[0] is not None:
        planned, stock = stock, (None, None)
    grads, savings = _named_forwards(op, planned, activations)
    if grads:
        backprop["forwarded_grads"][op.name] = grads
    if savings:
        backprop["workspace_forwards"][op.name] = savings
    if stock[0] is not None:
        (backprop["stock_forwarded_grads"][op.name],
         backprop["stock_workspace_forwards"][op.name]) = _named_forwards(op, stock, activations)


def _record_scratch_taken_over(op, differentiated, activations, backprop):
    """Adds to `op`'s `workspace_forwards` the buffers its gradient kernels take
    for scratch where they read them last (`workspace.gradient_scratch_forwards`),
    for the rewrite's order only (where it orders the gradient ops: `gated`).
    Stock's order does not make the kernel read them last: another reader (the
    next layer's weight gradient, a skip connection's) may run after it or
    beside it, and then the kernel copies (a chain of max pools under stock:
    predicted 1 MiB under measured, with one inter-op thread as with several).
    Stock keeps what it had."""
    savings = _named_savings(
        op, workspace.gradient_scratch_forwards(op, differentiated), activations)
    if not savings:
        return
    planned = backprop["workspace_forwards"].get(op.name, ())
    backprop["stock_workspace_forwards"].setdefault(op.name, planned)
    backprop["workspace_forwards"][op.name] = planned + savings


def _named_forwards(op, found, activations):
    """`found` ((forwards, scratch_forwards) of a gradient_reads.Reads) as the model
    names them: (`GraphModel.forwarded_grads`, `workspace_forwards`) of `op`."""
    forwards, scratch_forwards = found
    return (_forwarded_grads(op, forwards, activations),
            _named_savings(op, scratch_forwards, activations))


def _named_savings(op, savings, activations):
    """`GraphModel.workspace_forwards` of `op`, from its probe's `scratch_forwards`."""
    return tuple((candidate, saved) for candidate, saved in (
        (_named_stand_in(op, *stand_in, activations), saved) for stand_in, saved in savings)
        if candidate is not None)


def _forwarded_grads(op, forwards, activations):
    """`GraphModel.forwarded_grads` of `op`, from its probe's `Reads.forwards`."""
    found = []
    for i, candidates in forwards:
        names = tuple(c for c in (_named_stand_in(op, *c, activations) for c in candidates)
                      if c is not None)
        if i < len(op.inputs) and op.inputs[i].name in activations and names:
            found.append((op.inputs[i].name, names))
    return tuple(found)


def _names_read(op, reads):
    """Names of the tensors `op`'s gradient reads (`reads`: its gradient_reads.Reads)."""
    read = ([op.inputs[i].name for i in reads.inputs if i < len(op.inputs)]
            + [op.outputs[i].name for i in reads.outputs if i < len(op.outputs)]
            + list(reads.captured))
    calls = op.type in ("PartitionedCall", "StatefulPartitionedCall") or compat.is_function_op(op)
    if calls and any(i >= len(op.outputs) for i in reads.outputs):
        # Outputs a function call gains when differentiated: its intermediates.
        # They are computed from its inputs (an input passed through is that
        # input's own buffer), so its inputs are what backprop keeps (a nested
        # call of `a * scale` kept every `a`). Loops and conds, which gain
        # outputs too, are left as they were (loop_memory prices loops).
        read += [t.name for t in op.inputs]
    return read


def _made_outside(op, read, differentiated, data) -> dict:
    """Buffer name -> bytes of the tensors of `read` (names `op`'s gradient
    reads) that the step makes from its data by ops outside the region (a
    rescaled image the stem's filter gradient reads, a frozen backbone's
    features), each named by the tensor whose buffer it is (a reshaped view is
    its source). Not fed ones nor dataset elements: those exist before the step
    (measured). Not a loop's: `loop_memory` prices what its chunks rerun from."""
    if op.type in loops.LOOP_OP_TYPES:
        return {}
    made = {}
    for t in op.inputs:
        if t.name in read and t.name not in differentiated and t.name in data:
            while True:  # to the buffer it is: a reshaped view or slice is its source's
                source = (t.op.inputs[0] if t.op.type in _PASS_THROUGH_OP_TYPES and t.op.inputs
                          else op_kinds.first_axis_view_of(t.op))
                if source is None:
                    break
                t = source
            if t.op.type not in op_kinds.DATA_SOURCE_OP_TYPES:
                made[t.name] = loop_memory.list_bytes(t)
    return made


def _variable_copies(op, read) -> dict:
    """Name -> bytes of the variables' values `op`'s gradient reads (names
    `read`) that are copies: once a gather of its handle (`tf.nn.embedding_lookup`
    of the variable) puts a variable in copy-on-read mode, TensorFlow copies it
    on every dense read, and the copy lives until its last reader (measured:
    a table gathered and read by a tied output layer, its 8 MiB copy held from
    the step's start to that layer's gradient). Gathers in other graphs are
    not seen."""
    return {t.name: op_kinds.tensor_bytes(t) for t in op.inputs
            if t.name in read and t.op.type == "ReadVariableOp"
            and any(c.type in _HANDLE_GATHER_OP_TYPES for c in t.op.inputs[0].consumers())}


def _record_backprop(op, op_inputs, activations, regions, settings, backprop):
    """What `op`'s gradient reads, allocates besides its results, sends to weights.

    `regions`: (names of the region's tensors and xs that are not activations,
    whose gradients are weight gradients; names of the region's tensors and the xs,
    what backprop takes gradients of: other inputs' gradient branches are pruned;
    names of the graph's per-example tensors, `DataTensors`; names of the xs).
    `settings`: whether Grappler folds the graph's products by one into
    identities (`identity_folding.folds_to_identities`), `Reading.gated`, and
    whether the executor runs independent ops at once
    (`workspace.several_inter_op_threads`). Returns whether the gradient is
    linear in the incoming gradients (`gradient_linearity`), and the
    `_WeightPart`s it sends to weights.
    """
    weights, differentiated, data, x_names = regions
    folds, gated, concurrent = settings
    name = op.name
    inputs_differentiated = [t.name in differentiated for t in op.inputs]
    linear = True
    if op.type in ("Exit", "RefExit"):
        read = [t.name for t in op_inputs]  # a v1 loop: assume it reads all it took in
        scratch = 0
    else:
        reads = gradient_reads.gradient_reads(op, inputs_differentiated, folds)
        read = _names_read(op, reads)
        scratch = reads.scratch_bytes
        if reads.early_bytes:
            backprop["early_workspace"][name] = reads.early_bytes
        backprop["ungraded"][name] = tuple(
            op.inputs[i].name for i in reads.ungraded if i < len(op.inputs))
        passed = tuple((op.inputs[i].name, op.outputs[j].name) for i, j in reads.passed
                       if i < len(op.inputs) and op.inputs[i].name in activations
                       and op.outputs[j].name in activations)
        if passed:
            backprop["passed_grads"][name] = passed
        _record_forwarding(op, reads, activations, backprop, gated)
        if gated:
            _record_scratch_taken_over(op, inputs_differentiated, activations, backprop)
        linear = reads.linear
    backprop["grad_reads"][name] = tuple(n for n in read if n in activations)
    outside = {**_made_outside(op, read, differentiated, data), **_variable_copies(op, read)}
    if outside:
        backprop["outside_reads"][name] = tuple(outside)
        backprop["outside_bytes"].update(outside)
    if broadcast_sinking.keeps_small(
            op, lambda reader: any(o.name in differentiated for o in reader.outputs)):
        backprop["small_grads"][name] = op_kinds.tensor_bytes(op.outputs[0])
    measured = workspace.gradient_workspace_bytes(op, differentiated=inputs_differentiated)
    # Stock tf.gradients' executor runs a convolution's input and filter gradients
    # at once where it has several threads (ResNet50 at 64 px: both kernels' 20 MiB
    # at its peak); the rewrite chains them (gradient_order.py).
    stock = workspace.gradient_workspace_bytes(op, concurrent, inputs_differentiated)
    if workspace.scratch_free_saves(op):  # the rewrite differentiates it its own way
        # Only the halves TensorFlow builds: the image's (input 0) and the
        # filter's (input 1; a frozen layer's filter is not differentiated).
        measured = conv_gradients.workspace_bytes(op, inputs_differentiated[0],
                                                  inputs_differentiated[1])
        # Its filter gradient is a chain of per-tap products that the executor
        # runs on beside the gradients below where leaf_order does not order
        # it (measured in the small CNN's plan before leaf_order: a
        # convolution's tap slices and image alive with the next batch norm's
        # gradient, with one inter-op thread as with several).
        filter_chain = conv_gradients.workspace_bytes(
            op, input_gradient=False, filter_gradient=inputs_differentiated[1])
        if filter_chain:
            backprop["trailing_workspace"][name] = filter_chain
    xla_dense = grouped_conv_calls.stock_workspace_bytes(op)
    if xla_dense and grouped_conv_calls.is_eligible(op):  # the rewrite takes native kernels
        stock += xla_dense
    elif xla_dense:
        measured += xla_dense
        stock += xla_dense
    backprop["workspace"][name] = scratch + measured
    if stock != measured:
        backprop["stock_workspace"][name] = scratch + stock
    parts = [part for part in (_weight_part(op, t, x_names) for t in op_inputs if t.name in weights
                               and (t.dtype.is_floating or t.dtype == tf.resource)) if part.bytes]
    backprop["weight_grad_bytes"][name] = sum(part.bytes for part in parts)
    return linear, parts


class _WeightPart(NamedTuple):
    """A gradient an op sends to a weight: the weight's name (a variable's
    handle for its value read through casts and identities, up to an x: where
    the parts are added up), the part's bytes, whether it is an IndexedSlices,
    the weight's bytes (of a dense gradient), the tensor the op reads, and
    whether that is the handle or a plain read of it (our rewrite adds such
    parts as they are made: rewrite.py, `to_xs`)."""
    weight: str
    bytes: int
    sparse: bool
    weight_bytes: int
    read: str
    plain: bool


def _weight_part(op, weight, x_names) -> _WeightPart:
    """The gradient `op` sends on to the weight `weight` is read from: for
    the table a gather reads whole rows of (a Keras `Embedding`'s read
    variable), an IndexedSlices of those rows and their indices; else the
    weight's size. Either in the dtype of the float the weight was cast from
    (a mixed-precision layer reads its float32 variable as float16; the
    gradient returned is float32). A variable's handle (an x) has a gradient
    only from the gathers that read it (`_handle_part`)."""
    if weight.dtype == tf.resource:
        return _handle_part(op, weight)
    source = _cast_source(weight)
    whole = op_kinds.tensor_elements(weight) * source.dtype.size
    summed_at = _summed_at(weight, x_names)
    plain = op_kinds.plain_read_handle(weight, x_names) is not None
    if (op.type in _ROW_GATHER_OP_TYPES and op.inputs[0] is weight
            and _gathers_along_first_axis(op) and _read_as_it_is(weight)):
        rows = (op_kinds.tensor_elements(op.outputs[0]) * source.dtype.size
                + op_kinds.tensor_bytes(op.inputs[1]))
        return _WeightPart(summed_at.name, rows, True, whole, weight.name, plain)
    return _WeightPart(summed_at.name, whole, False, whole, weight.name, plain)


def _summed_at(weight, x_names) -> tf.Tensor:
    """Where the gradients sent to `weight` meet the others of its variable: the
    variable's handle, through the casts, identities and read from it, or the
    first x on the way (tf.gradients stops there: two reads asked for apart
    get two gradients)."""
    source = _cast_source(weight, x_names)
    if source.name in x_names:
        return source
    return source.op.inputs[0] if source.op.type == "ReadVariableOp" else weight


def _handle_part(op, handle) -> _WeightPart:
    """The gradient `op` sends to the variable behind `handle`, read in
    place (`tf.gather` or `tf.nn.embedding_lookup` of a variable, a tf_keras
    Embedding): an IndexedSlices of the rows read and their indices for
    ResourceGather, and for ResourceGatherNd with one index per row; else
    the variable's size (ResourceGatherNd scatters its gradient dense). None
    from other ops: TensorFlow registers gradients to a handle for these alone."""
    spec = compat.resource_spec(handle)
    if (op.type not in _HANDLE_GATHER_OP_TYPES or op.inputs[0] is not handle or spec is None
            or not spec.dtype.is_floating):
        return _WeightPart(handle.name, 0, False, 0, handle.name, True)
    whole = spec.shape.num_elements() * spec.dtype.size if spec.shape.is_fully_defined() else 0
    indices = op.inputs[1]
    if op.type == "ResourceGather" or (indices.shape.rank == 2 and indices.shape[-1] == 1):
        rows = (op_kinds.tensor_elements(op.outputs[0]) * spec.dtype.size
                + op_kinds.tensor_bytes(indices))
        return _WeightPart(handle.name, rows, True, whole, handle.name, True)
    return _WeightPart(handle.name, whole, False, whole, handle.name, True)


def _weight_sums(parts_by_weight, gated: bool) -> dict:
    """`GraphModel.weight_sums` from weight -> [(op, `_WeightPart`)]: the
    weights of known size sent several parts, each by an op sending no other
    (the model holds an op's weight gradients as one buffer). `gated`: the
    rewrite orders the gradient ops (adds parts as they are made)."""
    parts_per_op = collections.Counter(
        op for parts in parts_by_weight.values() for op, _ in parts)
    sums = {}
    for weight, parts in parts_by_weight.items():
        ops = [op for op, _ in parts]
        size = max(part.weight_bytes for _, part in parts)
        if len(ops) < 2 or not size or any(parts_per_op[op] > 1 for op in ops):
            continue
        summed = WeightSum(weight=weight, parts=tuple(ops),
                           sparse=frozenset(op for op, part in parts if part.sparse),
                           bytes=size, reads=tuple(part.read for _, part in parts),
                           as_made=gated and all(part.plain for _, part in parts))
        sums.update(dict.fromkeys(ops, summed))
    return sums


def _gathers_along_first_axis(op) -> bool:
    """Whether a gather's gradient for its table is an IndexedSlices: axis 0
    as TensorFlow's gather gradient sees it (`tf.get_static_value`), no batch
    dimensions; that gradient is dense otherwise."""
    if op.type == "Gather":
        return True
    axis = tf.get_static_value(op.inputs[2])
    return axis is not None and int(axis) == 0 and op.get_attr("batch_dims") == 0


def _read_as_it_is(table) -> bool:
    """Whether `table` is a variable's value or a fed tensor through casts and
    identities only: any other op between (a scale, a slice, a reshape) makes
    the IndexedSlices dense on its way to the variable."""
    return _cast_source(table).op.type in ("ReadVariableOp", "Placeholder")


def _cast_source(tensor, stops=frozenset()):
    """`tensor` before the float casts and identities it went through, back to
    the first of the names `stops` on the way."""
    while (tensor.name not in stops and tensor.op.type in ("Cast", "Identity")
           and tensor.op.inputs and tensor.op.inputs[0].dtype.is_floating):
        tensor = tensor.op.inputs[0]
    return tensor
