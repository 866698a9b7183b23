"""Making an optimizer's work that needs no gradient wait for the gradient it serves.

An optimizer's update of a variable often starts with arithmetic that needs no
gradient: momentum SGD's `m * momentum`, RMSprop's decay of its average,
AdamW's weight decay. TF's executor runs an op as soon as its inputs exist, so
all of it runs at the start of a training step, and each weight-sized result
is kept until that variable's gradient comes, late in backprop: the step holds
about one more copy of the weights (a weight decay assigned while backprop
still reads the old value copies the variable). `wait_for_gradients` makes each
such op wait for the one gradient it serves. Values do not change: the op reads
what it read before, and reads and writes of a variable keep the order the
function's automatic control dependencies give them.

Which gradient an op serves is read from the optimizer's ops as the function
will run them: data edges, control edges, and the order automatic control
dependencies will put on the ops that use one variable (not yet added while
the step is being traced): a read waits for the write before it, a write for
every use since the write before it.
"""

from __future__ import annotations

from typing import Optional

import networkx as nx
import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import gradient_waits

# Ops that hand an input on unchanged: output k needs what input k needs.
_PASS_THROUGH_OP_TYPES = frozenset({"Identity", "IdentityN"})
# A tf.function's first trace makes these where it creates variables.
_CREATES_VARIABLES = frozenset({"VarHandleOp", "VarIsInitializedOp"})


def wait_for_gradients(gradients: list, ops: list, uses: Optional[dict] = None) -> int:
    """Makes the ops of `ops` that would be kept waiting for one of
    `gradients` wait for it before they run. Returns how many now wait.

    Such an op needs none of `gradients`, leads to the update of exactly one
    gradient's variable, and either writes a variable (a weight decay) or
    makes more than one element that an op needing the gradient reads,
    directly or through other such ops. Work that ends in a scalar (Lamb's
    norm of a weight) is left to run early: there its result is small, and
    made later its weight-sized temporaries would meet the step's peak.

    Args:
      gradients: the weight gradients an optimizer was given (Tensors,
        IndexedSlices or None), all made before `ops`.
      ops: the ops the optimizer made with them, in the order they were made,
        in a tf.function's graph (elsewhere nothing waits: only there do
        automatic control dependencies keep each variable's reads and writes
        in the order they were made). Nothing waits in the trace that creates
        the optimizer's variables either: tf.function lifts their initial
        values out of the graph, which a wait would tie to it (under XLA an
        error); the trace after it, which runs every later step, waits.
      uses: `compat.ordered_uses` of ops, filled in as they are found: one
        dict shared by this module's calls on one update's ops finds them once
        (about 40 us an op, a good part of a deep model's trace).
    """
    if not _may_reorder(ops):
        return 0
    inside = set(ops)
    before, after = _variable_order(ops, uses)
    needs = _needs(gradients, ops, inside, before)
    serves = _serves(ops, inside, needs, after)
    waiting = set()
    for op in reversed(ops):
        if needs[op] or len(serves[op]) != 1 or not op.inputs:
            continue
        if _writes_a_variable(op) or (_makes_more_than_one_element(op) and any(
                needs[c] or c in waiting
                for out in op.outputs for c in out.consumers() if c in inside)):
            waiting.add(op)
    for op in ops:
        if op in waiting:
            (index,) = serves[op]
            compat.add_control_input(op, gradient_waits.gradient_values(gradients[index]).op)
    return len(waiting)


def hold_next_levels_for_updates(gradients: list, ops: list,
                                 uses: Optional[dict] = None) -> int:
    """Makes each gate that waits for one of `gradients` (gradient_waits.gate:
    the next level's recomputation, or a recomputed layer's input gradient,
    waits for it) wait too for the ops of `ops` that write a variable with
    that gradient alone. Returns how many gradients' updates gates now wait for.

    With one inter-op thread TensorFlow's executor may run on down the chain
    of backprop and queue the updates beside it until that chain ends, each
    weight gradient and the update's own weight-sized temporaries held to the
    end of the step (eight 1024-wide layers decorated under RECOMPUTE=1:
    65-69 MiB in one process of five, where the step otherwise peaks at 17).
    Values do not change: a gradient's update is held back from no op that
    runs after it now or that automatic control dependencies will order
    after it (the reads and writes of one variable keep their order, as do
    stateful ops that take no variable: a CheckNumerics, a print); where
    a wait would close a cycle (a variable shared with a lower layer, whose
    gradient comes after that gate), that gradient's update is left as it is.
    Same conditions and `uses` as `wait_for_gradients`.
    """
    if not _may_reorder(ops):
        return 0
    needs = _needs(gradients, ops, set(ops), _variable_order(ops, uses)[0])
    writes = {}  # gradient index -> the ops writing a variable with it alone
    for op in ops:
        if len(needs[op]) == 1 and _writes_a_variable(op):
            writes.setdefault(next(iter(needs[op])), []).append(op)
    tensors = {index: gradient_waits.gradient_tensors(gradients[index]) for index in writes}
    gates = {index: [found for t in tensors[index]
                     for found in gradient_waits.gates_waiting_for(t)] for index in writes}
    gates = {index: found for index, found in gates.items() if found}
    if not gates:
        return 0
    # An update's readers of its gradient will wait for each gate's read of
    # it (below): once they do, an op before such a read runs before the
    # update's writes too (a gate upstream of another gate of the same
    # gradient, two levels of a stacked LSTM's backprop, closed a cycle).
    before_writes = {index: writes[index] + [read for _, read in gates[index]
                                             if read is not None] for index in gates}
    reached = _writes_reached(ops[0].graph, [g for found in gates.values() for g, _ in found],
                              before_writes, uses)
    # Index a leads to b where a gate of a's gradient runs before one of b's
    # writes (or of the reads they will wait for): waits for both would close
    # a cycle through a and b.
    leads_to = nx.DiGraph()
    leads_to.add_nodes_from(gates)
    for a, found in gates.items():
        mask = 0
        for gate, _ in found:
            mask |= reached[gate]
        leads_to.add_edges_from((a, b) for b in gates if mask >> b & 1)
    while not nx.is_directed_acyclic_graph(leads_to):
        leads_to.remove_node(nx.find_cycle(leads_to)[0][0])
    inside = set(ops)
    for index in leads_to:
        readers = [c for t in tensors[index] for c in t.consumers() if c in inside]
        for gate, read in gates[index]:
            for op in writes[index]:
                compat.add_control_input(gate, op)
            # The gate's read first, as it ran before: then the update's
            # last read of the gradient may take its buffer (momentum SGD's
            # `learning_rate * gradient` does).
            for op in readers if read is not None else ():
                compat.add_control_input(op, read)
    return leads_to.number_of_nodes()


def _writes_reached(graph: tf.Graph, starts: list, writes: dict, uses: Optional[dict]) -> dict:
    """For each op of `starts` and each op after one, a bit mask of the
    indices b such that it will run before an op of `writes[b]` (the ops
    index b's writes will wait for, themselves among them) once the
    function's automatic control dependencies are added (by data and control
    edges, and by the order of the ops using one resource). One walk over the
    ops after any of `starts`, each op's mask made of its successors'."""
    after = _variable_order(graph.get_operations(), uses)[1]
    own = {}
    for index, ops in writes.items():
        for op in ops:
            own[op] = own.get(op, 0) | 1 << index

    def successors(op):
        return ([c for out in op.outputs for c in out.consumers()]
                + compat.control_outputs(op) + after.get(op, []))

    reached, open_ops = {}, set()
    for start in starts:
        if start in reached:
            continue
        stack = [[start, successors(start), 0]]  # op, successors, next to visit
        open_ops.add(start)
        while stack:
            frame = stack[-1]
            op, following, position = frame
            while position < len(following) and (following[position] in reached
                                                 or following[position] in open_ops):
                position += 1
            if position < len(following):
                frame[2] = position + 1
                child = following[position]
                stack.append([child, successors(child), 0])
                open_ops.add(child)
                continue
            mask = own.get(op, 0)
            for child in following:
                mask |= reached.get(child, 0)  # an open one: a cycle, already in the graph
            reached[op] = mask
            open_ops.discard(op)
            stack.pop()
    return reached


def pass_gradients_straight(gradients: list, ops: list, uses: Optional[dict] = None) -> int:
    """Makes the ops of `ops` that read gradients through an `IdentityN` over
    several of them read them past it. Returns how many `IdentityN` are
    passed by.

    Keras's optimizers gather the gradients so (the default replica context's
    all-reduce, after any `clipnorm`, `clipvalue` or loss-scale division of
    each): no update can start before every gradient is made, so all of them
    are held at once. Grappler's dependency optimizer removes it, but only in
    a function that returns a value, as `fit`'s step does; a training step
    returning nothing keeps it. An `IdentityN` is passed by where each of its
    inputs is a gradient or is made from one by `ops`. Values do not change:
    an `IdentityN` hands each input on as it is. Same conditions and `uses`
    as `wait_for_gradients`.
    """
    if not _may_reorder(ops):
        return 0
    gradient_refs = {t.ref() for g in gradients if g is not None
                     for t in gradient_waits.gradient_tensors(g)}
    inside = set(ops)
    needs = _needs(gradients, ops, inside, _variable_order(ops, uses)[0])

    def from_a_gradient(tensor):
        return tensor.ref() in gradient_refs or (tensor.op in inside and needs[tensor.op])

    passed = 0
    for op in ops:
        if (op.type != "IdentityN" or len(op.inputs) < 2
                or not all(from_a_gradient(t) for t in op.inputs)):
            continue
        for given, out in zip(op.inputs, op.outputs):
            for consumer in out.consumers():
                if consumer in inside:
                    for index, read in enumerate(consumer.inputs):
                        if read is out:
                            compat.replace_input(consumer, index, given)
        passed += 1
    return passed


def _may_reorder(ops: list) -> bool:
    """Whether `ops` are in a tf.function's graph, which keeps each variable's
    reads and writes in the order they were made, and not in the trace that
    creates variables (their initial values are lifted out of the graph)."""
    return bool(ops) and compat.orders_stateful_ops(ops[0].graph) and not any(
        op.type in _CREATES_VARIABLES for op in ops)


def _needs(gradients, ops, inside, before) -> dict:
    """For each op, the indices of the gradients it cannot run without."""
    needed_by = {}  # tensor ref -> indices of the gradients it needs
    for index, gradient in enumerate(gradients):
        for tensor in gradient_waits.gradient_tensors(gradient) if gradient is not None else ():
            needed_by.setdefault(tensor.ref(), set()).add(index)
    needs = {}
    for op in ops:
        ins = [needed_by.get(t.ref(), set()) for t in op.inputs]
        waits = set().union(*(needs[c] for c in op.control_inputs if c in inside),
                            *(needs[p] for p in before[op]))
        needs[op] = set().union(waits, *ins)
        for k, out in enumerate(op.outputs):
            needed_by[out.ref()] = (ins[k] | waits if op.type in _PASS_THROUGH_OP_TYPES
                                    else needs[op])
    return needs


def _serves(ops, inside, needs, after) -> dict:
    """For each op, the indices of the gradients needed by the first ops
    after it (data, control, variable order) that need any."""
    serves = {}
    for op in reversed(ops):
        later = [c for out in op.outputs for c in out.consumers()]
        later += compat.control_outputs(op) + after[op]
        serves[op] = set().union(*(needs[c] or serves[c] for c in later if c in inside))
    return serves


def _variable_order(ops: list, uses: Optional[dict]) -> tuple:
    """For each op, the earlier and the later of `ops` that automatic control
    dependencies will order it after and before, by the resources it uses
    (and, as writes of one more resource, the stateful ops that take none).
    `uses`, where given, caches `compat.ordered_uses` by op."""
    uses = {} if uses is None else uses
    chains = {}  # resource tensor ref (None: no resource) -> (op, writes it), in order
    for op in ops:
        if op not in uses:
            uses[op] = compat.ordered_uses(op)
        for resource, writes in uses[op]:
            chains.setdefault(None if resource is None else resource.ref(),
                              []).append((op, writes))
    before = {op: [] for op in ops}
    after = {op: [] for op in ops}
    for chain in chains.values():
        last_write, reads = None, []
        for op, writes in chain:
            waits_for = ([last_write] if last_write else []) + (reads if writes else [])
            for earlier in waits_for:
                before[op].append(earlier)
                after[earlier].append(op)
            if writes:
                last_write, reads = op, []
            else:
                reads.append(op)
    return before, after


def _writes_a_variable(op: tf.Operation) -> bool:
    # Written while backprop still reads the old value, a variable is copied.
    return any(writes for resource, writes in compat.ordered_uses(op) if resource is not None)


def _makes_more_than_one_element(op: tf.Operation) -> bool:
    # Scalars (learning rates, step counts) are shared by every update and cost nothing.
    return any(out.shape.num_elements() is None or out.shape.num_elements() > 1
               for out in op.outputs)
