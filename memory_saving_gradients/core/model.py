"""The graph model: the forward region between xs and ys, as plain typed data.

Everything in core/ reads this and nothing else, so strategies, planning and
simulation can be tested without TensorFlow (tfgraph/reading.py builds it).

Vocabulary used across the package:

* activation: a region tensor that carries per-example data. Only
  activations are checkpointed or recomputed; tensors that depend only on the
  xs (variable reads, casts of weights) are parameter-sized and always kept.
* recomputable: an op that may be copied and rerun with the same result.
* pinned: activations that must be kept (outputs and activation inputs of
  ops that cannot be recomputed, among them the ops producing xs inside the
  region).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional, Tuple

import networkx as nx

# What a dimension of the step's inputs unknown when traced counts as: Keras's
# default batch size, a typical one.
UNKNOWN_DIM_SIZE = 32
# Plans for such a step are chosen as for a batch this many times larger
# (`GraphModel.scaled`, `strategies.for_any_batch`).
UNKNOWN_DIM_CHOICE_SCALE = 16


@dataclasses.dataclass(frozen=True)
class Activation:
    """One activation tensor and what the planner needs to know of it.

    Attributes:
      name: the tensor's name, e.g. 'dense/Relu:0'.
      op: name of the op producing it.
      op_type: that op's type, e.g. 'Relu'.
      bytes: size from the static shape (`GraphModel.unsized`).
      cost: rough FLOPs of the producing op.
      recomputable: whether that op may be copied and rerun.
      is_float: whether the tensor is floating point (integer and shape
        tensors are never worth a checkpoint of their own).
    """
    name: str
    op: str
    op_type: str
    bytes: int
    cost: int
    recomputable: bool
    is_float: bool


@dataclasses.dataclass(frozen=True)
class Loop:
    """What a v2 While op keeps for its gradient, per iteration.

    Attributes:
      trip_count: its `maximum_iterations` when known before it runs (or what
        its condition allows); for one known only at run time, the count the
        rewrite's chunks are laid out for (`loop_chunks.planned_trips`); else
        None (then one iteration is counted: a lower bound).
      iteration_bytes: bytes the stock gradient (while_v2) pushes onto its
        per-iteration stacks each iteration, kept from the loop's run until
        backprop reaches it.
      written_bytes: bytes its body writes per iteration into the TensorLists
        it carries (a Keras RNN's output sequence): a rerun of the loop
        builds T iterations of them again.
      state_bytes: bytes of its carried floating state (one chunk boundary).
      chunk_size: k when the package reruns it in chunks of k iterations
        (tfgraph/loop_chunks.py), None when it is rerun whole or never.
      states_saved_in_place: whether, differentiated where it is, its forward
        run saves the chunk boundaries (else a chain of chunks rerun from its
        inputs makes them during its gradient: one more run).
      states_saved_when_recomputed: whether a copy the plan recomputes takes
        the forward run's outputs and saved boundaries (else a chain of
        chunks reruns it in its level).
      ahead_bytes: bytes per iteration of the body's values that do not wait
        for its carried state (an RNN's input projection): TensorFlow's
        executor computes them up to `parallel_iterations` iterations ahead,
        each held until its iteration's state arrives.
      parallel_iterations: how many iterations the executor may run at once.
      stacked_items: (name of an output list the model counts, bytes per
        iteration) for each item the body writes into such a list that its
        stacks hold too (a scan's h_t): a run that keeps its stacks holds
        those list items once.
      outside_bytes: bytes of its float inputs made outside the region from
        the step's inputs alone (a Keras RNN's time-major input list): a
        rerun reads them again, so they live until its gradient when the
        plan reruns the loop.
      invariant_bytes: bytes of its float loop invariants (the weights its
        body reads): each gradient of it, a chunk's included, sums their
        gradients over its iterations in buffers of their size.
      gathered_bytes: bytes of the variables its body gathers rows of (an
        embedding table): each gradient of it makes every iteration's sparse
        gradient of one dense and adds it to a dense sum, holding buffers of
        the table's size beside the gradient it returns
        (`loop_chunking.GATHERED_SUM_BUFFERS`).
    """
    trip_count: Optional[int]
    iteration_bytes: int
    state_bytes: int
    written_bytes: int = 0
    chunk_size: Optional[int] = None
    states_saved_in_place: bool = True
    states_saved_when_recomputed: bool = True
    ahead_bytes: int = 0
    parallel_iterations: int = 1
    stacked_items: Tuple[Tuple[str, int], ...] = ()
    outside_bytes: int = 0
    invariant_bytes: int = 0
    gathered_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class WeightSum:
    """The gradient of one weight (a variable, or an x) that several ops send
    parts of: a table read by an embedding and by the output layer tied to
    it, a block applied several times. tf.gradients adds the parts once the
    last is made, with AddN over one of their buffers where any is dense,
    each IndexedSlices made dense as soon as it exists; concatenated where
    all are IndexedSlices.

    Our rewrite adds a variable's reads' parts as they are made where each
    part comes through a plain read of the variable (`as_made`): the parts
    one `tf.gradients` call makes to one read (or, in the call from the ys, to
    the handle) are added when that call's last is made, and those sums in turn.

    Attributes:
      weight: the weight's name (a variable's handle, or the x).
      parts: the ops sending parts.
      sparse: those of `parts` whose part is an IndexedSlices (a gather's rows).
      bytes: the weight's bytes: of the sum, and of each sparse part made dense.
      reads: the tensor each of `parts` reads the weight as (a read of the
        variable, the handle, the x), in the same order.
      as_made: whether our rewrite adds the parts as they are made.
    """
    weight: str
    parts: Tuple[str, ...]
    sparse: frozenset
    bytes: int
    reads: Tuple[str, ...] = ()
    as_made: bool = False

    @property
    def dense_sum(self) -> bool:
        """Whether the parts are added dense (any of them is)."""
        return len(self.sparse) < len(self.parts)


@dataclasses.dataclass(frozen=True)
class GraphModel:
    """The activations between xs and ys and how they depend on each other.

    Attributes:
      graph: DiGraph over activation names; an edge a -> b means b's op reads a.
      tensors: activation name -> Activation.
      order: activation names in a topological order (the order they were
        made in; backprop is replayed in its reverse).
      forward_order: the same names in the order the forward pass is taken to
        run them (`forward_order.freeing_ops_sooner`); empty: `order`.
      pinned: activations that must be kept, whole ops at a time.
      ys: names of the ys that are activations.
      op_outputs: op name -> its activation output names (the unit a
        checkpoint is expanded to, so no output of a copied op is forgotten).
      other_bytes: bytes of region tensors that are not activations (weights).
      num_region_ops: how many ops lie between xs and ys.
      grad_reads: op name -> the activations (its inputs and outputs) its
        registered gradient reads, as TensorFlow builds it; ops left out are
        taken to read every activation input and output.
      workspace: op name -> bytes its gradient ops allocate besides their
        results while they run (scratch buffers, intermediate tensors).
      weight_grad_bytes: op name -> bytes of the gradients it sends to
        weights (region tensors and xs that are not activations).
      weight_sums: op name -> the `WeightSum` its weight gradient is a part
        of, for weights several ops send gradients to.
      stock_workspace: op name -> `workspace` of stock tf.gradients where it
        differs from the rewrite's (ops the rewrite differentiates with a
        gradient of its own, such as 1x1 convolutions as matrix products).
      loops: op name -> `Loop`, for the v2 While ops among the ops.
      run_workspace: op name -> bytes the op's own kernel allocates besides
        its outputs while it runs, forward and recomputed (a CPU transposed
        convolution's scratch).
      recompute_workspace: op name -> `run_workspace` of its recomputed
        copies where it differs (a transposed convolution the rewrite
        recomputes without the kernel's scratch).
      trailing_workspace: op name -> scratch of a part of the rewrite's
        gradient of the op that runs on beside the gradients below it (a
        chain of per-tap filter-gradient products): it and what the op's
        gradient reads stay alive up to and with the next such op's gradient.
      ungraded: op name -> its activation inputs its gradient makes no
        gradient for (a tf.custom_gradient's IdentityN: the results it
        passes through).
      early_workspace: op name -> bytes of the parts of its gradient that
        read only forward tensors: TensorFlow runs them when the op runs and
        holds them until backprop (where the rewrite differentiates the op
        in a level, they wait for the gradient instead).
      shared_buffers: activation -> the activation input whose buffer it
        is, for ops that pass inputs through by index (IdentityN); ops of
        `timeline.ALIASING_OP_TYPES` share their first input's.
      merged: activation -> an activation an earlier, identical op makes
        (same type, inputs, attributes, device and control inputs, no side
        effects): TensorFlow runs the two as one op, so their buffer is one
        where both are made in the same pass (the forward pass, or one
        level's copies).
      small_grads: op name -> bytes of the gradient the rewrite sends its
        input where that is not the input's size: a mean or sum with static
        shapes, whose gradient's broadcast the rewrite moves into the ops
        that read it (tfgraph/broadcast_sinking.py); stock tf.gradients
        makes the full-size one.
      passed_grads: op name -> (activation input, activation output) pairs:
        the input's gradient is that output's gradient itself (BiasAdd's; an
        AddV2's without a reduction), no buffer of its own where that
        gradient comes in one piece.
      forwarding: op name -> (output, activation inputs) pairs: the output
        may take one of those inputs' buffers, tried in that order, where the
        op is the input's last reader (an element-wise kernel's
        `forward_input_or_allocate_output`; dtype and shape match).
      forwarded_grads: op name -> (activation input, candidates) pairs: the
        kernel making that input's gradient is element-wise and may write it
        over a candidate it reads last; each candidate is ("grad", output),
        that output's incoming gradient, or ("value", activation), a forward
        tensor the gradient reads (ReluGrad over its `dy` or its `y`).
      workspace_forwards: op name -> (candidate, bytes) pairs, candidates as
        in `forwarded_grads`: its gradient's `workspace` is that much less
        where the candidate's buffer dies with the gradient (an intermediate
        is written over it: SquaredDifference's `x - y` over `x`).
      stock_forwarded_grads, stock_workspace_forwards: op name -> the same
        for stock tf.gradients where they differ (the rewrite orders a
        broadcast product's two gradient products, stock does not).
      weights_first: ops whose weight gradient the rewrite runs before
        their input gradient (a convolution's filter gradient, when its
        output is the smaller): the activations only the weight gradient
        reads are free before the input gradient is allocated. Stock
        leaves the two unordered.
      outside_reads: op name -> the buffers of tensors its gradient reads that
        the step makes from its data by ops outside the region (a rescaled
        image the stem's filter gradient reads, a frozen backbone's features),
        each named by the tensor that made it (a view's source): alive from the
        step's start until that gradient has run, whatever the plan. Not
        activations: never kept or recomputed by a plan.
      outside_bytes: buffer name -> bytes, for the buffers of `outside_reads`.
      deferred_weight_gradient_types: op types whose weight gradients stock
        tf.gradients' executor defers until its chain of data gradients
        stops, holding what they read (one inter-op thread:
        `stock_order.WEIGHTS_LISTED_FIRST` where TensorFlow's own kernels
        run); `timeline.step_peaks` then replays stock in the executor's order.
      unsized: activation name -> its static shape, as text, for activations
        whose shape leaves a dimension unknown when traced (a batch of a
        dataset batched without drop_remainder); their `bytes` count each
        unknown dimension of the step's inputs as `unknown_dim_size`.
      weight_gradients_taken: an optimizer in the same graph takes each weight
        gradient as it is made (Keras's `fit`), so the step's peak is the one
        `timeline.activation_peak` counts, not the one with every weight
        gradient held to the end; `"memory"` ranks its plans by it.
      unknown_dim_size: what each unknown dimension of the step's inputs
        counts as in `bytes`: `UNKNOWN_DIM_SIZE` unless the graph was read
        for a size the user gave (`budget(max_bytes, batch_size=n)`).
    """
    graph: nx.DiGraph
    tensors: Mapping[str, Activation]
    order: tuple[str, ...]
    pinned: frozenset[str]
    ys: tuple[str, ...]
    op_outputs: Mapping[str, tuple[str, ...]]
    forward_order: tuple[str, ...] = ()
    other_bytes: int = 0
    num_region_ops: int = 0
    grad_reads: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    workspace: Mapping[str, int] = dataclasses.field(default_factory=dict)
    weight_grad_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    weight_sums: Mapping[str, WeightSum] = dataclasses.field(default_factory=dict)
    stock_workspace: Mapping[str, int] = dataclasses.field(default_factory=dict)
    loops: Mapping[str, Loop] = dataclasses.field(default_factory=dict)
    run_workspace: Mapping[str, int] = dataclasses.field(default_factory=dict)
    recompute_workspace: Mapping[str, int] = dataclasses.field(default_factory=dict)
    trailing_workspace: Mapping[str, int] = dataclasses.field(default_factory=dict)
    ungraded: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    shared_buffers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    merged: Mapping[str, str] = dataclasses.field(default_factory=dict)
    early_workspace: Mapping[str, int] = dataclasses.field(default_factory=dict)
    small_grads: Mapping[str, int] = dataclasses.field(default_factory=dict)
    passed_grads: Mapping[str, tuple[tuple[str, str], ...]] = dataclasses.field(
        default_factory=dict)
    forwarding: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]] = dataclasses.field(
        default_factory=dict)
    forwarded_grads: Mapping[str, tuple[tuple[str, tuple[tuple[str, str], ...]], ...]] = (
        dataclasses.field(default_factory=dict))
    workspace_forwards: Mapping[str, tuple[tuple[tuple[str, str], int], ...]] = (
        dataclasses.field(default_factory=dict))
    stock_forwarded_grads: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    stock_workspace_forwards: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    outside_reads: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    outside_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    weights_first: frozenset[str] = frozenset()
    deferred_weight_gradient_types: frozenset[str] = frozenset()
    unsized: Mapping[str, str] = dataclasses.field(default_factory=dict)
    weight_gradients_taken: bool = False
    unknown_dim_size: int = UNKNOWN_DIM_SIZE

    def scaled(self, factor: int) -> "GraphModel":
        """This model with its `unsized` activations `factor` times their bytes:
        as at a batch `factor` times the assumed one (their gradients follow;
        kernel scratch and the weights do not)."""
        tensors = {n: dataclasses.replace(a, bytes=a.bytes * factor) if n in self.unsized else a
                   for n, a in self.tensors.items()}
        return dataclasses.replace(self, tensors=tensors)

    def returned_gradient_bytes(self) -> int:
        """Bytes of the weight gradients the step returns: each op's, but one
        sum for each weight several ops send parts to (`weight_sums`)."""
        sums = {summed.weight: summed for summed in self.weight_sums.values()}
        alone = sum(size for op, size in self.weight_grad_bytes.items()
                    if op not in self.weight_sums)
        return alone + sum(
            summed.bytes if summed.dense_sum
            else sum(self.weight_grad_bytes[op] for op in summed.parts)
            for summed in sums.values())

    def op_of(self, name: str) -> str:
        """The op producing activation `name`."""
        return self.tensors[name].op

    def bytes_of(self, names: Iterable[str]) -> int:
        """Total bytes of the activations `names`."""
        return sum(self.tensors[n].bytes for n in names)
