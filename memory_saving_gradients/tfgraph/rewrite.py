"""Rewrite: execute a Plan on a TensorFlow graph.

The only module that adds ops. It never changes an existing op: it adds
copies of each level's segment, makes them wait for the gradient that
reaches the level (so recomputation runs late, not during the forward pass),
calls the stock tf.gradients on the copies, and sums the partial gradients.

Copies read per-level identity stubs of the checkpoints and weights they use,
so each level's tf.gradients call walks only its own segment instead of the
whole graph; the weights' partial gradients reach the xs in one final call.
That keeps the rewrite near-linear in graph size.
"""

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import default_gradient
from tensorflow.python.ops import gradients_impl

from memory_saving_gradients.tfgraph import loop_chunks
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import waiting

# Captured at import so that patching tf.gradients never makes us call ourselves.
_stock_gradients = gradients_impl.gradients


def backprop(model, plan, ys, xs, grad_ys, stop_gradients, tf_kwargs, unconnected):
    """Gradients of `ys` with respect to `xs` under `plan`. Returns a list."""
    graph = ys[0].graph
    # Rerunnable loops differentiated in place are rerun in chunks as well.
    loops_here = loops.rerunnable_loops(
        {graph.get_tensor_by_name(name).op for name in model.region})
    with loop_chunks.chunked_gradients(loops_here):
        return _backprop(model, plan, ys, xs, grad_ys, stop_gradients, tf_kwargs, unconnected)


def _backprop(model, plan, ys, xs, grad_ys, stop_gradients, tf_kwargs, unconnected):
    graph = ys[0].graph
    checkpoints = [graph.get_tensor_by_name(n) for n in plan.checkpoints]
    # Each source once: tf.gradients answers every entry of a repeated source
    # (an x given twice, or an x that is also a checkpoint), and every answer
    # would be collected as one more partial gradient.
    sources = list({t.name: t for t in checkpoints + list(xs)}.values())
    unique_xs = list({x.name: x for x in xs}.values())
    leaves = _Leaves(model, plan, xs, graph)
    # tf.gradients differentiates function calls even at stop_gradients (see
    # _is_function_call): a part it has sent through such an op already is
    # kept apart, to count in the full gradient but never be sent again.
    parts = {}  # tensor name -> partial gradients still to send through its op
    passed = {}  # tensor name -> partial gradients already sent through its op

    def gradients_to(sources, targets, seeds, stops, names=None):
        calls = {t.op for t in stops + stop_gradients if _is_function_call(t.op)}
        # A call at a stop is differentiated anyway, by SymbolicGradient, which
        # fails at run time on a function holding a loop; left out of our
        # stops it gets its registered gradient. The user's stops stay as given.
        stops = [t for t in stops if t.op not in calls] + stop_gradients
        first_new_op = len(graph.get_operations()) if calls else None
        # tf.compat.v1 TensorArray gradients meet in an accumulator named after
        # the gradient scope up to its last part starting with 'gradients'. A
        # scope name without that prefix keeps all our calls on the caller's
        # scope (as for one tf.gradients call), so a TensorArray read in one
        # call and written in another gets the whole gradient.
        grads = _stock_gradients(targets, sources, seeds, name="backprop",
                                 stop_gradients=stops, **tf_kwargs)
        through = set()
        if calls:
            # Function calls among the stops that tf.gradients differentiated
            # all the same (their gradient ops record them as their forward op).
            new_ops = graph.get_operations()[first_new_op:]
            through = calls & {op._original_op for op in new_ops}  # pylint: disable=protected-access
        for name, g in zip(names or [t.name for t in sources], grads):
            if g is not None:
                done = bool(through) and graph.get_tensor_by_name(name).op in through
                (passed if done else parts).setdefault(name, []).append(g)

    # Backprop from the ys through the original ops, down to the checkpoints.
    gradients_to(sources, ys, grad_ys, checkpoints)

    # Sums stay IndexedSlices when every part is (tf.gradients takes them as
    # grad_ys), so sparse gradients reach the xs sparse, as with tf.gradients.
    seeds = {}  # checkpoint -> its full gradient
    unsent = {}  # checkpoint -> the part of it still to send through its op
    for number, level in reversed(list(enumerate(plan.levels))):
        for c in level.checkpoints:
            late, early = parts.pop(c, []), passed.pop(c, [])
            if late or early:
                seeds[c] = _sum(late + early)
            if late:
                unsent[c] = _sum(late) if early else seeds[c]
        with graph.name_scope(f"recompute_{number}"):
            stubs = {}
            # Numeric ones only: a loop's TensorList gradient is a variant.
            arrived = [seeds[c] for c in level.checkpoints
                       if c in seeds and waiting.addable(waiting.values(seeds[c]).dtype)]
            copies = _copy_segment(graph, level, seeds,
                                   lambda t: leaves.stub(t, stubs, arrived))
            roots = [c for c in level.checkpoints if c in copies and c in seeds]
            if roots:
                mapped = [copies.get(s.name, s) for s in stop_gradients]
                gradients_to(list(stubs.values()), [copies[c] for c in roots],
                             [seeds[c] for c in roots], mapped, names=list(stubs))
            kept = [graph.get_tensor_by_name(c) for c in level.checkpoints
                    if c in unsent and c not in copies and _differentiable(c, graph)]
            if kept:
                # Roots that cannot be recomputed (stateful, control flow):
                # differentiate the original ops.
                read = _kept_inputs(model, leaves, graph, kept)
                gradients_to(read, kept, [unsent[t.name] for t in kept], read)

    # Weights (region tensors that depend only on xs) to the xs, in one pass.
    weights = [n for n in parts if leaves.is_weight(n)]
    if weights:
        gradients_to(unique_xs, [graph.get_tensor_by_name(n) for n in weights],
                     [_sum(parts.pop(n)) for n in weights], [])

    results = []
    for x in xs:
        # An x inside the region is a checkpoint; its seed is its full gradient.
        grad = (seeds.get(x.name) if x.name in plan.checkpoints
                else _sum(parts.get(x.name, []) + passed.get(x.name, [])))
        if grad is None and unconnected == tf.UnconnectedGradients.ZERO:
            grad = default_gradient.zeros_like(x)
        results.append(grad)
    return results


class _Leaves:
    """The tensors recomputation reads and must send gradients to.

    Those are checkpoints, weights (region tensors that are not activations)
    and xs. Copies read identity stubs of them, made per level: a stub's only
    consumers are that level's copies, so tf.gradients started from stubs
    walks one segment, not the whole graph.
    """

    def __init__(self, model, plan, xs, graph):
        self._model = model
        self._checkpoints = frozenset(plan.checkpoints)
        self._x_names = frozenset(x.name for x in xs)
        self._xla = control_flow_util.GraphOrParentsInXlaContext(graph)

    def is_weight(self, name):
        return name in self._model.region and name not in self._model.graph

    def wanted(self, name):
        return name in self._checkpoints or name in self._x_names or self.is_weight(name)

    def stub(self, tensor, stubs, arrived):
        """The level's stub for `tensor` (made on first use), or `tensor` itself.

        `arrived` are the numeric gradients reaching the level. XLA (jit_compile)
        drops the control inputs that make copies wait for them, then runs
        the copies early or merges them with their originals (CSE, even
        through optimization barriers on CPU). So under XLA the stub also
        reads one of those gradients: a data dependency XLA must respect.
        """
        if not self.wanted(tensor.name):
            return tensor
        if tensor.name not in stubs:
            if self._xla and arrived and waiting.addable(tensor.dtype):
                stub = waiting.after(tensor, arrived[0])
            else:
                stub = tf.identity(tensor)
            stub.op._set_device(tensor.op.device)  # pylint: disable=protected-access
            stubs[tensor.name] = stub
        return stubs[tensor.name]


def _copy_segment(graph, level, seeds, stub):
    """Copies the level's ops; returns original tensor name -> copied tensor.

    Ops that read no other copy get control inputs on the gradients of the
    checkpoints they serve, so the executor cannot run them early.
    """
    copies = {}
    for op_name in level.copy_ops:
        owners = [seeds[c] for c in level.owners[op_name] if c in seeds]
        if not owners:
            continue  # serves only checkpoints that receive no gradient
        op = graph.get_operation_by_name(op_name)
        inputs = [copies[i.name] if i.name in copies else stub(i) for i in op.inputs]
        waits = [] if any(i.name in copies for i in op.inputs) else [g.op for g in owners]
        if waits and op.type in loops.LOOP_OP_TYPES:
            # Differentiating a loop appends data inputs to it, and a node's
            # control inputs must follow its data inputs: it waits through them.
            with graph.control_dependencies(waits):
                inputs = [tf.identity(i) for i in inputs]
            waits = []
        if op.type in loops.LOOP_OP_TYPES:
            # Rerun in chunks when its trip count is known (loop_chunks.py).
            outputs = loop_chunks.copy_loop(op, inputs)
        else:
            with graph.control_dependencies(waits):
                new = graph._create_op_internal(  # pylint: disable=protected-access
                    op.type, inputs, dtypes=[o.dtype for o in op.outputs],
                    name=op.name, attrs=dict(op.node_def.attr),
                    op_def=op.op_def, compute_device=False)
            new._set_device(op.device)  # pylint: disable=protected-access
            outputs = new.outputs
        for old_t, new_t in zip(op.outputs, outputs):
            new_t.set_shape(old_t.shape)
            copies[old_t.name] = new_t
    return copies


def _is_function_call(op):
    """True for ops tf.gradients differentiates even at stop_gradients.

    tf.gradients (gradients_util._GradientsHelper) gives every function call
    (PartitionedCall, StatefulPartitionedCall, a graph function called by its
    name) a gradient even when its outputs are in stop_gradients: a
    SymbolicGradient op instead of the call's registered gradient.
    """
    return (op.type in ("PartitionedCall", "StatefulPartitionedCall")
            or op.graph._is_function(op.type))  # pylint: disable=protected-access


def _kept_inputs(model, leaves, graph, kept):
    """The tensors to differentiate kept roots to: what their ops read.

    Past a function call among them tf.gradients goes on to the call's own
    inputs, so those are taken too (and so on); else the gradient it sends
    there would be lost, or counted again where another root reads them.
    """
    read = {}
    names = [n for t in kept for n in model.op_inputs[t.op.name]]
    for name in names:  # grows while it is walked
        if name in read or not leaves.wanted(name):
            continue
        read[name] = tensor = graph.get_tensor_by_name(name)
        if _is_function_call(tensor.op):
            names.extend(model.op_inputs.get(tensor.op.name, ()))
    return list(read.values())


def _differentiable(name, graph):
    """False for ops registered as not differentiable (random ops, shapes)."""
    try:
        return tf_ops.get_gradient_function(graph.get_tensor_by_name(name).op) is not None
    except LookupError:
        return True  # let tf.gradients raise its own error if it is ever needed


def _sum(parts):
    """Sums partial gradients; IndexedSlices stay sparse when all parts are."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, tf.IndexedSlices) for p in parts):
        index_dtype = tf.int64 if any(p.indices.dtype == tf.int64 for p in parts) else tf.int32
        return tf.IndexedSlices(
            tf.concat([p.values for p in parts], axis=0),
            tf.concat([tf.cast(p.indices, index_dtype) for p in parts], axis=0),
            parts[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(p) for p in parts])
