"""Graph model: read the forward ops between xs and ys once into a plain networkx graph.

Everything after this module (selection, planning, simulation) sees only the
`GraphModel`, never TensorFlow objects, so it can be tested without TF.

Vocabulary used across the package:

* region: ops that depend on some x and that some y depends on (data edges only).
* activation: a region tensor that carries per-example data (it depends on a
  data input such as a placeholder or a tf.function argument). Only activations
  are checkpointed or recomputed; tensors that depend only on xs (variable
  reads, casts of weights) are parameter-sized and always kept.
* recomputable: an op that may be copied and rerun. Stateful ops (random ops,
  variable reads), control flow and function calls are not: their outputs and
  activation inputs are pinned as checkpoints instead. The exception is a
  tf.function-style (v2) while loop whose body only reads variables that
  nothing assigns meanwhile (`loops.rerunnable_loops`): rerunning it late
  frees the per-iteration state that its gradient keeps, which is most of a
  recurrent network's memory.
"""

import dataclasses
import math

import networkx as nx
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from memory_saving_gradients.tfgraph import gradient_reads
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import workspace

# Ops whose copies would not behave like the original (or could not be
# differentiated when copied): their outputs are kept instead of recomputed.
CONTROL_FLOW_OP_TYPES = frozenset({
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
    "RefExit", "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger",
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "SymbolicGradient",
})

# Ops that feed per-example data into a graph.
DATA_SOURCE_OP_TYPES = frozenset({
    "Placeholder", "PlaceholderV2", "PlaceholderWithDefault", "IteratorGetNext",
    "IteratorGetNextSync", "IteratorGetNextAsOptional", "OptionalGetValue",
})

_OPAQUE_DTYPES = (tf.resource, tf.variant, tf.string)


@dataclasses.dataclass(frozen=True)
class GraphModel:
    """The forward region between xs and ys, as plain data.

    Attributes:
      graph: DiGraph over activation tensor names; an edge a -> b means b's op
        reads a. Node attributes: ``op`` (op name), ``op_type``, ``bytes``
        (from the static shape, unknown dims counted as 1), ``cost`` (rough
        FLOPs of the producing op), ``recomputable`` (bool), ``float`` (bool).
      order: activation tensor names in a topological order.
      pinned: activation tensors that must be kept: outputs and activation
        inputs of ops that cannot be recomputed, and xs inside the region,
        with every activation output of the ops producing them.
      ys: names of the ys that are activations.
      op_outputs: op name -> its activation output names (the unit a
        checkpoint is expanded to, so no output of a copied op is forgotten).
      other_bytes: bytes of region tensors that are not activations (weights).
      region: names of the tensors produced between xs and ys (not those
        inside a tf.compat.v1 while loop, see `unit_inputs`).
      num_region_ops: how many ops lie between xs and ys.
      op_inputs: op name -> names of the tensors its gradient reaches: its
        inputs, or for the Exit ops of a tf.compat.v1 while loop, the tensors
        entering the loop. Only the rewrite reads it.
      grad_reads: op name -> the activation tensors (its inputs and outputs)
        its registered gradient reads, as TensorFlow builds it.
      workspace: op name -> bytes its gradient ops allocate besides their
        outputs while they run (measured; empty when not measurable).
      weight_grad_bytes: op name -> bytes of the gradients it sends to
        weights (region tensors that are not activations).
    """
    graph: nx.DiGraph
    order: tuple
    pinned: frozenset
    ys: tuple
    op_outputs: dict
    other_bytes: int
    region: frozenset
    num_region_ops: int
    op_inputs: dict = dataclasses.field(default_factory=dict)
    grad_reads: dict = dataclasses.field(default_factory=dict)
    workspace: dict = dataclasses.field(default_factory=dict)
    weight_grad_bytes: dict = dataclasses.field(default_factory=dict)

    def op_of(self, tensor_name):
        return self.graph.nodes[tensor_name]["op"]

    def tensor_bytes(self, names):
        return sum(self.graph.nodes[n]["bytes"] for n in names)


def is_recomputable(op, rerunnable_loops=frozenset()):
    """True if rerunning a copy of `op` gives the same values and gradients.

    v2 while loops are recomputable only if in `rerunnable_loops` (see loops.py).
    """
    if in_v1_control_flow(op):
        return False  # inside a tf.compat.v1 while/cond body
    if op.type in loops.LOOP_OP_TYPES:
        return op in rerunnable_loops
    if op.type in CONTROL_FLOW_OP_TYPES or op.op_def.is_stateful:
        return False
    if op.graph._is_function(op.type):  # pylint: disable=protected-access
        return False  # call of a graph function by its own op type
    tensors = list(op.inputs) + list(op.outputs)
    return not any(t.dtype._is_ref_dtype or t.dtype.base_dtype in _OPAQUE_DTYPES  # pylint: disable=protected-access
                   for t in tensors)


def in_v1_control_flow(op, output=False):
    """True if `op` (with `output`: its outputs) is in a tf.compat.v1 while/cond body.

    Ops under jit_compile sit in an XLA context, which is not a body; an
    Exit op sits in its loop's context, but its outputs live after the loop.
    """
    context = (control_flow_util.GetOutputContext(op) if output
               else op._get_control_flow_context())  # pylint: disable=protected-access
    while context is not None:
        if context.IsWhileContext() or context.IsCondContext():
            return True
        context = context.outer_context
    return False


def tensor_bytes(t):
    """Bytes of `t` from its static shape; unknown dims count as 1."""
    dims = t.shape.as_list() if t.shape.rank is not None else []
    elements = math.prod(d if d is not None else 1 for d in dims)
    size = t.dtype.size if t.dtype.base_dtype not in _OPAQUE_DTYPES else 8
    return int(elements * size)


def op_cost(op):
    """Rough FLOPs of `op`: exact-ish for contractions, output size otherwise."""
    out_elems = sum(tensor_bytes(o) // max(o.dtype.size, 1) for o in op.outputs
                    if o.dtype.base_dtype not in _OPAQUE_DTYPES)
    if op.type in ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        shape = op.inputs[0].shape
        inner_axis = -2 if op.get_attr("adj_x" if "adj_x" in op.node_def.attr
                                       else "transpose_a") else -1
        inner = shape[inner_axis] if shape.rank else None
        return 2 * out_elems * (inner or 1)
    if op.type.startswith(("Conv", "DepthwiseConv")) and len(op.inputs) > 1:
        kernel = op.inputs[1].shape
        if kernel.rank and kernel.is_fully_defined():
            return 2 * out_elems * math.prod(kernel.as_list()[:-1])
    return out_elems


def data_tensors(graph):
    """Names of the tensors of `graph` that carry per-example data.

    Those are the tensors a data input reaches through ops, not counting
    resource tensors (variable handles). Variants count: a TensorList made
    from the input (as Keras' RNNs feed a loop) carries its data. Found by one
    forward search from the data inputs, linear in the graph size; searching
    forward (not memoising a backward walk) stays correct on tf.compat.v1
    while loops, whose NextIteration -> Merge back edges make the graph cyclic.
    """
    data = set()
    stack = [op for op in graph.get_operations() if op.type in DATA_SOURCE_OP_TYPES]
    while stack:
        for t in stack.pop().outputs:
            if t.name not in data and t.dtype.base_dtype != tf.resource:
                data.add(t.name)
                stack.extend(t.consumers())
    return data


def region_ops(ys, xs):
    """Ops that depend on some x and that some y depends on, in topological order.

    Linear in the size of the graph. Ops are created after their inputs, so op
    creation order is topological (loop back edges aside, which we never copy).
    """
    reached = set()
    stack = [c for x in xs for c in x.consumers()]
    while stack:
        op = stack.pop()
        if op not in reached:
            reached.add(op)
            stack.extend(c for o in op.outputs for c in o.consumers())
    between = set()
    stack = [y.op for y in ys]
    while stack:
        op = stack.pop()
        if op in reached and op not in between:
            between.add(op)
            stack.extend(i.op for i in op.inputs)
    return sorted(between, key=lambda op: op._id)  # pylint: disable=protected-access


def _outermost_while_loop(op):
    """The outermost tf.compat.v1 while loop (WhileContext) `op` is in, or None."""
    loop = None
    context = getattr(op, "_control_flow_context", None)
    while context is not None:
        if context.IsWhileContext():
            loop = context
        context = context.outer_context
    return loop


def unit_inputs(ops):
    """Op -> the tensors it reads, with each tf.compat.v1 while loop as one unit.

    Tensors inside a v1 while loop exist once per iteration: tf.gradients can
    neither seed nor stop at them from outside the loop. So the ops inside a
    loop are left out, and each of the loop's Exit ops reads every tensor that
    enters the loop. Other ops (v2 While is one op already) read their inputs.
    """
    inputs = {}
    entering = {}  # loop -> tensors that enter it, in order
    for op in ops:
        loop = _outermost_while_loop(op)
        if loop is None:
            inputs[op] = list(op.inputs)
            continue
        outside = entering.setdefault(loop, {})
        outside.update((i.name, i) for i in op.inputs
                       if _outermost_while_loop(i.op) is not loop)
    for op in ops:
        # Exit ops belong to their loop's context, and are its only outputs.
        if op.type in ("Exit", "RefExit"):
            inputs[op] = list(entering[_outermost_while_loop(op)].values())
    return inputs


def build_model(ys, xs):
    """Read the region between `xs` and `ys` (lists of tensors) into a GraphModel."""
    ops = region_ops(ys, xs)
    in_region = set(ops)
    x_names = {x.name for x in xs}
    data = data_tensors(ys[0].graph)
    inputs = unit_inputs(ops)
    units = [op for op in ops if op in inputs]
    rerunnable = loops.rerunnable_loops(units)

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

    graph = nx.DiGraph()
    pinned = set()
    op_outputs = {}
    other_bytes = 0
    backprop = {"grad_reads": {}, "workspace": {}, "weight_grad_bytes": {}}
    region_names = {o.name for op in units for o in op.outputs}
    for op in units:
        outs = [o for o in op.outputs if o.name in activations]
        if not outs:
            other_bytes += sum(tensor_bytes(o) for o in op.outputs)
            continue
        _record_backprop(op, inputs[op], activations, region_names, backprop)
        recomputable = is_recomputable(op, rerunnable)
        cost = op_cost(op)
        op_outputs[op.name] = tuple(o.name for o in outs)
        act_inputs = [i.name for i in inputs[op] if i.name in activations]
        for o in outs:
            graph.add_node(o.name, op=op.name, op_type=op.type, bytes=tensor_bytes(o),
                           cost=cost, recomputable=recomputable,
                           float=o.dtype.is_floating)
            graph.add_edges_from((i, o.name) for i in act_inputs)
        if not recomputable:
            pinned.update(o.name for o in outs)
            pinned.update(act_inputs)
        pinned.update(o.name for o in outs if o.name in x_names)

    order = tuple(n for op in units for n in op_outputs.get(op.name, ()))
    # Whole ops: tf.gradients stops at ops, so a kept output's recomputed
    # sibling would lose its gradient.
    pinned = {o for n in pinned for o in op_outputs[graph.nodes[n]["op"]]}
    return GraphModel(
        graph=graph, order=order, pinned=frozenset(pinned),
        ys=tuple(y.name for y in ys if y.name in activations),
        op_outputs=op_outputs, other_bytes=other_bytes,
        region=frozenset(region_names),
        num_region_ops=len(ops),
        op_inputs={op.name: tuple(i.name for i in inputs[op]) for op in units},
        **backprop)



def _record_backprop(op, op_inputs, activations, region_names, backprop):
    """What `op`'s gradient reads, allocates as scratch and sends to weights."""
    if op.type in ("Exit", "RefExit"):
        read = [t.name for t in op_inputs]  # a v1 loop: assume it reads all it took in
        scratch = 0
    else:
        reads = gradient_reads.gradient_reads(op)
        read = ([op.inputs[i].name for i in reads.inputs]
                + [op.outputs[i].name for i in reads.outputs])
        scratch = reads.scratch_bytes
    backprop["grad_reads"][op.name] = tuple(n for n in read if n in activations)
    backprop["workspace"][op.name] = scratch + workspace.gradient_workspace_bytes(op)
    backprop["weight_grad_bytes"][op.name] = sum(
        tensor_bytes(t) for t in op_inputs
        if t.name in region_names and t.name not in activations and t.dtype.is_floating)
