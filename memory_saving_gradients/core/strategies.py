"""Selection: strategies that choose which activations to keep.

Every strategy has the same shape, ``strategy(model) -> Selection``, and knows
nothing of TensorFlow, so a new strategy is one new function here:

* `speed`: keep outputs of expensive ops (contractions); recompute the cheap
  elementwise ops between them.
* `memory`: keep about sqrt(n) bottlenecks, spaced so segments are equal in
  bytes; on graphs without single-tensor bottlenecks, keep small separator sets.
* `explicit`: keep exactly the given tensors (a list, or the 'checkpoints'
  collection, read by the caller).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math

import networkx as nx

from memory_saving_gradients.core import planning
from memory_saving_gradients.core.model import GraphModel
from memory_saving_gradients.core import simulation

logger = logging.getLogger(__name__)

EXPENSIVE_OP_TYPES = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "Conv", "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
    "Conv3DBackpropInputV2", "_FusedMatMul", "_FusedConv2D",
})


@dataclasses.dataclass(frozen=True)
class Selection:
    """Chosen checkpoint tensor names, and remarks on how they were chosen."""
    names: frozenset
    notes: tuple = ()


def explicit(model: GraphModel, names) -> Selection:
    """Keeps exactly `names` (activation tensor names of `model`)."""
    return Selection(frozenset(n for n in names if n in model.graph))


def speed(model: GraphModel) -> Selection:
    """Keeps outputs of matmuls, convolutions and einsums; recomputes the rest once.

    Tensors that several segments would recompute (a residual stream between
    two matmuls) are kept too, bottlenecks among them first, so no op is
    recomputed more than once and segments stay short. A copied contraction
    whose output nothing reads is never run: its gradient needs only its
    inputs. O(n) per pass, at most a few passes.
    """
    tensors = model.tensors
    chosen = {n for n in model.order
              if tensors[n].op_type in EXPENSIVE_OP_TYPES and tensors[n].is_float
              and n not in model.ys}
    streams = set(bottlenecks(model))
    for _ in range(4):
        shared = planning.shared_tensors(
            model, planning.expand_to_ops(model, chosen) | model.pinned) - set(model.ys)
        if not shared:
            break
        chosen |= (shared & streams) or shared
    return Selection(frozenset(chosen))


def memory(model: GraphModel) -> Selection:
    """Keeps ~sqrt(n) bottlenecks: the plan with the lowest simulated peak.

    Bottlenecks are tensors every path from the data to the ys passes
    through (immediate dominators, near-linear to find). When there are none,
    as in U-Nets or DenseNets, it keeps separator sets instead: every tensor
    alive across a cut of the topological order, at the cheapest cuts.

    Example: on a 100-layer tanh chain it keeps 10 tensors, one every 10 layers.
    """
    order = model.order
    if not order:
        return Selection(frozenset())
    dominators = [n for n in bottlenecks(model) if model.tensors[n].is_float]
    plans = [(_price(model, chosen), chosen, "bottleneck")
             for chosen in _spaced_choices(model, dominators)]
    plans += [(_price(model, chosen), chosen, "separator")
              for chosen in _separator_choices(model)]
    if not plans:
        return Selection(frozenset())
    _, chosen, kind = min(plans, key=lambda p: (p[0], len(p[1])))
    notes = ()
    if kind == "separator":
        notes = (f"no usable single-tensor bottleneck between xs and ys "
                 f"({len(dominators)} found); kept {len(chosen)} tensors that "
                 f"separate the graph at its cheapest cuts instead",)
        logger.warning("memory_saving_gradients: %s", notes[0])
    return Selection(frozenset(chosen), notes)


_NAMED = {"memory": memory, "speed": speed}
# Every `checkpoints` mode; 'collection' keeps the names the caller read from
# the graph's collection, a list (mode 'list') the names given.
MODES = ("collection", "memory", "speed")


def validate(checkpoints) -> str:
    """The mode of a `checkpoints` argument: a mode name, or 'list' for a sequence.

    The one place an unknown mode is refused, for every way in.
    """
    if isinstance(checkpoints, str):
        if checkpoints not in MODES:
            raise ValueError(f"unknown checkpoints mode {checkpoints!r}: use one of "
                             f"{', '.join(map(repr, MODES))} or a list of tensors")
        return checkpoints
    return "list"


def select(model: GraphModel, mode: str, names=()) -> Selection:
    """Runs the strategy of `mode`; 'collection' and 'list' keep exactly `names`."""
    if mode in _NAMED:
        return _NAMED[mode](model)
    return explicit(model, names)


def bottlenecks(model: GraphModel) -> list:
    """Activations on every path from the data inputs to the ys, in order.

    Computed as the dominators of a super-sink fed by the ys, from a
    super-source feeding the first activations (Cooper-Harvey-Kennedy,
    near-linear). Example: [h1, h2, h3] for the chain x -> h1 -> h2 -> h3 -> y.
    """
    if not model.ys:
        return []
    source, sink = ("source",), ("sink",)  # tuples never clash with tensor names
    graph = nx.DiGraph(model.graph.edges)
    graph.add_nodes_from(model.graph)
    graph.add_edges_from((source, n) for n in model.graph
                         if model.graph.in_degree(n) == 0)
    graph.add_edges_from((y, sink) for y in model.ys)
    idom = nx.immediate_dominators(graph, source)
    chain = []
    node = idom[sink]
    while node != source:
        chain.append(node)
        node = idom[node]
    return [n for n in reversed(chain) if n not in model.ys]


def _price(model, chosen):
    plan = planning.make_plan(model, chosen, "memory")
    est = simulation.estimate(model, plan)
    return est.peak_bytes, est.recompute_flops


def _positions(model):
    """Cumulative activation bytes at each tensor of the topological order."""
    total = 0
    positions = []
    for n in model.order:
        total += max(model.tensors[n].bytes, 1)
        positions.append(total)
    return positions


def _counts_to_try(limit, n):
    """Checkpoint counts worth simulating: all when few, else a geometric sweep
    from sqrt(n)/4 to 4*sqrt(n), where the optimum of k + n/k lies."""
    if limit <= 24:
        return range(1, limit + 1)
    low, high = max(1.0, math.sqrt(n) / 4), min(limit, 4 * math.sqrt(n))
    counts, k = set(), low
    while k <= high:
        counts.add(round(k))
        k *= 1.25
    return sorted(counts) or [min(limit, max(1, math.isqrt(n)))]


def _spaced_choices(model, candidates):
    """For several counts k, k candidates spaced evenly by activation bytes."""
    if not candidates:
        return []
    rank = {n: i for i, n in enumerate(model.order)}
    positions = _positions(model)
    cand_pos = [positions[rank[c]] for c in candidates]
    total = positions[-1]
    choices = []
    for k in _counts_to_try(len(candidates), len(model.order)):
        chosen = set()
        for j in range(1, k + 1):
            i = bisect.bisect_left(cand_pos, j * total / (k + 1))
            near = min((i - 1, i), key=lambda q: abs(cand_pos[q] - j * total / (k + 1))
                       if 0 <= q < len(cand_pos) else math.inf)
            chosen.add(candidates[near])
        choices.append(frozenset(chosen))
    return list(dict.fromkeys(choices))


def _separator_choices(model):
    """For several counts k, the tensors alive across k cheap topological cuts."""
    order = model.order
    rank = {n: i for i, n in enumerate(order)}
    end = len(order)
    last_use = [max((rank[s] for s in model.graph.successors(n)), default=end)
                for n in order]
    for y in model.ys:
        last_use[rank[y]] = end
    # live[p]: bytes of tensors produced at or before p and read after p.
    delta = [0] * (end + 1)
    for i, n in enumerate(order):
        delta[i] += model.tensors[n].bytes
        delta[last_use[i]] -= model.tensors[n].bytes
    live, running = [], 0
    for p in range(end):
        running += delta[p]
        live.append(running)
    positions = _positions(model)
    total = positions[-1]
    choices = []
    for k in _counts_to_try(max(1, math.isqrt(end) * 2), end):
        cuts = set()
        for j in range(1, k + 1):
            lo = bisect.bisect_left(positions, (j - 0.5) * total / (k + 1))
            hi = bisect.bisect_right(positions, (j + 0.5) * total / (k + 1))
            window = range(lo, max(lo + 1, min(hi, end - 1)))
            cuts.add(min(window, key=live.__getitem__, default=lo))
        chosen = {order[i] for p in cuts for i in range(p + 1)
                  if last_use[i] > p and order[i] not in model.ys}
        if chosen:
            choices.append(frozenset(chosen))
    return list(dict.fromkeys(choices))
