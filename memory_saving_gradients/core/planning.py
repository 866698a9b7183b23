"""Planning: turn a set of checkpoint tensors into the segments the rewrite copies.

Pure functions on a `GraphModel`; no TensorFlow. The rewrite executes a `Plan`
exactly, and the simulator prices the same `Plan`, so what is predicted is
what is built.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from memory_saving_gradients.core import op_table
from memory_saving_gradients.core.model import GraphModel


@dataclasses.dataclass(frozen=True)
class Level:
    """Checkpoints whose gradients are all final at the same point of backprop.

    Attributes:
      checkpoints: checkpoint tensor names in this level.
      copy_ops: op names to recompute, in topological order.
      owners: op name -> checkpoints of this level whose recomputation needs
        that op; its copy must wait for those checkpoints' gradients.
    """
    checkpoints: tuple
    copy_ops: tuple
    owners: dict


@dataclasses.dataclass(frozen=True)
class LoopModes:
    """How a plan differentiates the rerunnable While loops it names (op names).

    A loop in neither set is the model's default: rerun in chunks (or whole)
    by the level that rebuilds it, or in chunks where it is in the tail.

    Attributes:
      in_place: loops whose outputs are kept and whose original op is
        differentiated where it is, in chunks from the states its forward run
        saved (one more run of the loop instead of one or two in a level).
      stacked: loops differentiated where they are (as `in_place`) by the
        stock gradient: every iteration's stacks kept from the forward pass,
        no rerun at all.
    """
    in_place: frozenset = frozenset()
    stacked: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the rewrite will do.

    Attributes:
      strategy: name of the selection that produced it.
      kept: every kept activation (chosen plus pinned), topological order.
      chosen: the checkpoints the strategy chose (without pinned ones).
      levels: processed from last to first during backprop.
      notes: human-readable remarks (fallbacks taken, inputs ignored).
      loops: how its rerunnable loops are differentiated (`LoopModes`).
      stock: the stock gradient itself (`stock_plan`): every activation kept
        as tf.gradients keeps it, nothing recomputed, no rewrite.
    """
    strategy: str
    kept: tuple
    chosen: tuple
    levels: tuple
    notes: tuple = ()
    loops: LoopModes = LoopModes()
    stock: bool = False

    @property
    def num_recomputed_ops(self) -> int:
        return sum(len(level.copy_ops) for level in self.levels)


def expand_to_ops(model: GraphModel, names: Iterable[str]) -> set:
    """All activation outputs of the ops producing `names`.

    Gradients stop per op, so keeping one output of a multi-output op and
    recomputing a sibling would drop the sibling's gradient contribution.
    """
    return {o for n in names for o in model.op_outputs[model.op_of(n)]}


def segment(model: GraphModel, root: str, checkpoints, in_place=frozenset()) -> tuple[set, set]:
    """Tensors recomputed to rebuild `root` from the checkpoints above it.

    Returns (recomputed tensor names, checkpoints read). A root that cannot be
    recomputed, or is an output of an op in `in_place`, is differentiated as it is. A recomputable root is always
    copied, even when every activation it reads is kept, so its gradient reads
    this level's inputs; TensorFlow never runs such a copy if its gradient
    does not read its output (matmuls, convolutions). O(size of the segment).
    """
    graph = model.graph
    if not model.tensors[root].recomputable or model.op_of(root) in in_place:
        return set(), set(graph.predecessors(root))
    recomputed, needed = {root}, set()
    stack = [root]
    while stack:
        for p in graph.predecessors(stack.pop()):
            if p in checkpoints:
                needed.add(p)
            elif p not in recomputed:
                recomputed.add(p)
                stack.append(p)
    return recomputed, needed


def kept_by_loops(model: GraphModel, loops) -> set:
    """What differentiating `loops` where they are keeps: their outputs, and
    the activations they read (their gradient reads the originals)."""
    rows = op_table.rows(model)
    return {t for op in loops for t in model.op_outputs[op] + rows[op].inputs}


def split_ops(model, checkpoints, segments, groups):
    """Outputs of dropped ops that more than one tf.gradients call would differentiate.

    The rewrite makes one call from the ys down to the checkpoints through the
    original ops, then one per level through that level's copies. tf.gradients
    sums an op's partial gradients before its gradient function sees them; an
    op reached by two calls would see each part alone, and a gradient that is
    not linear in the incoming one (a clipping custom gradient) gives
    f(a) + f(b) instead of f(a + b). Such ops must be kept, so their parts are
    summed first. `segments`: checkpoint -> (recomputed, read); `groups`: the
    levels' checkpoint sets. Linear in the total size of the segments.
    """
    tensors = model.tensors
    first_call = {tensors[t].op: -1 for t in _top_region(model, checkpoints)}
    split = set()  # ops a second call reaches
    for number, group in enumerate(groups):
        for c in group:
            for t in segments[c][0] - checkpoints:
                op = tensors[t].op
                if first_call.setdefault(op, number) != number:
                    split.add(op)
    return {t for op in split for t in model.op_outputs[op] if tensors[t].is_float}


def _top_region(model, checkpoints):
    """Activations the first call (ys down to the checkpoints) walks through."""
    seen = set()
    stack = [y for y in model.ys if y not in checkpoints]
    while stack:
        t = stack.pop()
        if t not in seen:
            seen.add(t)
            stack.extend(p for p in model.graph.predecessors(t) if p not in checkpoints)
    return seen


def make_plan(model: GraphModel, chosen: Iterable[str], strategy: str, notes=(),
              loops: LoopModes = LoopModes()) -> Plan:
    """Builds the Plan that keeps `chosen` plus the model's pinned tensors, and
    the outputs of the loops `loops` differentiates where they are.

    Each checkpoint's segment is the ops between it and the nearest checkpoints
    above it. Checkpoints are grouped into levels (layers of the dependency
    order) so a level is recomputed only after every checkpoint that reads it
    has sent its gradient. Ops that two gradient calls would reach are kept
    too (`split_ops`), a pass per round of additions (rarely more than one).
    Linear in the model size per level and pass.
    """
    rank = op_table.per_model(model, "tensor_rank",
                              lambda m: {n: i for i, n in enumerate(m.order)})
    op_rank = op_table.per_model(model, "op_rank",
                                 lambda m: {op: i for i, op in enumerate(op_table.order(m))})
    in_place = loops.in_place | loops.stacked
    checkpoints = (expand_to_ops(model, chosen) | set(model.pinned)
                   | expand_to_ops(model, kept_by_loops(model, in_place)))
    while True:
        segments = {c: segment(model, c, checkpoints, in_place) for c in checkpoints}
        groups = _layers({c: read for c, (_, read) in segments.items()}, rank)
        split = split_ops(model, checkpoints, segments, groups)
        if not split:
            break
        checkpoints |= expand_to_ops(model, split)
    levels, tensors = [], model.tensors
    for group in groups:
        owners = {}
        for c in group:
            for op in {tensors[t].op for t in segments[c][0]}:
                owners.setdefault(op, []).append(c)
        levels.append(Level(
            checkpoints=tuple(group),
            copy_ops=tuple(sorted(owners, key=op_rank.__getitem__)),
            owners={op: tuple(cs) for op, cs in owners.items()}))
    return Plan(strategy=strategy,
                kept=tuple(sorted(checkpoints, key=rank.__getitem__)),
                chosen=tuple(sorted(expand_to_ops(model, chosen), key=rank.__getitem__)),
                levels=tuple(levels), notes=tuple(notes), loops=loops)


def stock_plan(strategy: str, notes=()) -> Plan:
    """The plan that changes nothing: tf.gradients as it is (no checkpoint,
    no level, loops and convolutions differentiated by their stock gradients).

    No set of checkpoints expresses it: keeping every activation still copies
    each recomputable root (`segment`), and keeping none reruns everything.
    """
    return Plan(strategy=strategy, kept=(), chosen=(), levels=(), notes=tuple(notes),
                stock=True)


def _layers(deps, rank):
    """Checkpoints grouped by their longest chain of dependencies, first layer first.

    The layers a Kahn-style topological sort gives, in one pass over the topological
    order instead of one pass per layer (thousands of layers on deep nets).
    """
    depth = {}
    for c in sorted(deps, key=rank.__getitem__):
        depth[c] = 1 + max((depth[d] for d in deps[c]), default=-1)
    layers = [[] for _ in range(1 + max(depth.values(), default=-1))]
    for c, d in depth.items():
        layers[d].append(c)
    return layers
