"""The simulated BFC allocator (core/allocator.py) on hand-made event sequences.

No TensorFlow. Every expected peak is worked out by hand from the rules in
the module's docstring (256-byte rounding, best fit, split only when the
chunk is at least twice the request, coalescing, regions from 2 MiB
doubling).
"""

import math

import networkx as nx

from memory_saving_gradients.core import allocator
from memory_saving_gradients.core import timeline
from memory_saving_gradients.core.model import Activation
from memory_saving_gradients.core.model import GraphModel

MIB = 2**20
KIB = 2**10


def test_requests_round_up_to_256_bytes():
    alloc = allocator.BestFitAllocator()
    assert alloc.allocate("a", 1) == 256
    assert alloc.allocate("b", 257) == 512
    assert alloc.allocate("c", 1024) == 1024
    assert alloc.peak_bytes == 256 + 512 + 1024


def test_a_chunk_under_twice_the_request_is_handed_out_whole():
    alloc = allocator.BestFitAllocator()
    alloc.allocate("big", 1500 * KIB)  # the 2 MiB region splits: 1500 KiB + 548 KiB free
    alloc.free("big")  # coalesces back to one free 2 MiB chunk
    assert alloc.allocate("next", 1100 * KIB) == 2 * MIB  # 2 MiB < 2 x 1100 KiB: not split
    assert alloc.in_use_bytes == 2 * MIB


def test_a_chunk_of_twice_the_request_or_more_is_split():
    alloc = allocator.BestFitAllocator()
    assert alloc.allocate("a", MIB) == MIB  # 2 MiB region = exactly twice: split
    assert alloc.allocate("b", 600 * KIB) == MIB  # the 1 MiB rest < 1200 KiB: whole
    assert alloc.in_use_bytes == 2 * MIB


def test_best_fit_takes_the_smallest_free_chunk_that_fits():
    alloc = allocator.BestFitAllocator()
    for key, size in (("a", 512 * KIB), ("gap1", 64 * KIB), ("b", 300 * KIB),
                      ("gap2", 64 * KIB)):
        alloc.allocate(key, size)
    alloc.free("a")  # free: 512 KiB at the start, 300 KiB between the gaps, 1104 KiB rest
    alloc.free("b")
    assert alloc.allocate("c", 200 * KIB) == 300 * KIB  # 300 < 2 x 200: whole
    assert alloc.allocate("d", 256 * KIB) == 256 * KIB  # 512 KiB split in two


def test_freed_neighbours_coalesce_into_one_chunk():
    alloc = allocator.BestFitAllocator()
    for key in "abcd":
        alloc.allocate(key, 512 * KIB)  # fills the 2 MiB region exactly
    alloc.free("b")
    alloc.free("c")  # b and c merge: 1 MiB free in one piece
    assert alloc.allocate("e", MIB) == MIB
    assert alloc.peak_bytes == 2 * MIB  # no new region was needed


def test_unmerged_free_chunks_do_not_serve_a_larger_request():
    alloc = allocator.BestFitAllocator()
    for key in "abcd":
        alloc.allocate(key, 512 * KIB)
    alloc.free("a")
    alloc.free("c")  # two free 512 KiB chunks, not adjacent
    # 1 MiB fits neither: a new region of 4 MiB, split (4 >= 2 x 1).
    assert alloc.allocate("e", MIB) == MIB
    assert alloc.in_use_bytes == 2 * MIB


def test_regions_double_from_2_mib_and_grow_to_fit():
    alloc = allocator.BestFitAllocator()
    alloc.allocate("a", 2 * MIB)  # region 1: 2 MiB, exactly used; next region 4 MiB
    alloc.allocate("b", 3 * MIB)  # region 2: 4 MiB < 2 x 3 MiB: whole
    assert alloc.in_use_bytes == 6 * MIB
    alloc.allocate("c", 20 * MIB)  # 8 -> 16 -> 32 MiB to fit; 32 < 40: whole
    assert alloc.in_use_bytes == 38 * MIB


def test_warm_up_counts_a_free_region_handed_out_whole():
    # Cold: 1 MiB then 1.5 MiB, each split from fresh regions of 2 and 4 MiB.
    events = [("alloc", "a", MIB), ("alloc", "b", 1536 * KIB), ("free", "a"), ("free", "b")]
    assert allocator.peak_chunk_bytes(events, warm_up=False) == MIB + 1536 * KIB
    # Warm: both regions free again; 1 MiB splits the 2 MiB one, 1.5 MiB does
    # not fit the 1 MiB left and splits the 4 MiB one (4 >= 2 x 1.5): the same.
    assert allocator.peak_chunk_bytes(events) == MIB + 1536 * KIB
    # A 1.5 MiB request alone, warm: the 2 MiB region is free, and 2 < 3: whole.
    assert allocator.peak_chunk_bytes([("alloc", "x", 1536 * KIB)]) == 2 * MIB


def test_lifetime_events_free_an_ops_inputs_after_its_outputs():
    born = {"x": (1, 1000), "y": (2, 1000), "alias": (2, 0)}
    last_use = {"x": 2, "y": math.inf, "alias": 2}
    events = allocator.lifetime_events(born, last_use, [(2, 500)])
    assert events == [("alloc", "x", 1000), ("alloc", "y", 1000),
                      ("alloc", ("scratch", 0), 500), ("free", ("scratch", 0)), ("free", "x")]


def test_the_estimate_of_a_chain_counts_whole_chunks():
    # tf.gradients on a chain of 3 ops of 1.2 MiB each (gradients read outputs).
    names = ["t0", "t1", "t2"]
    graph = nx.DiGraph()
    graph.add_edges_from(zip(names, names[1:]))
    size = 1200 * KIB
    model = GraphModel(
        graph=graph, order=tuple(names), pinned=frozenset(), ys=(names[-1],),
        tensors={n: Activation(name=n, op=n, op_type="Op", bytes=size, cost=1,
                               recomputable=True, is_float=True) for n in names},
        op_outputs={n: (n,) for n in names}, num_region_ops=3,
        grad_reads={n: (n,) for n in names})
    estimate = timeline.with_allocator_peaks(model, None, timeline.predict(model))
    # Requested: t0, t1, t2 and the gradients into t1 and t0 all alive: 5 x 1200 KiB.
    assert estimate.peak_bytes == 5 * size
    # The warm-up replay leaves free regions of 2, 4 and 8 MiB. Then t0 takes the
    # 2 MiB region whole (2048 < 2400 KiB), t1 and t2 split the 4 MiB one
    # (leaving 1696 KiB), the gradient into t1 takes those 1696 KiB whole and
    # the gradient into t0 splits the 8 MiB region.
    assert estimate.allocator_baseline_bytes == (2048 + 1200 + 1200 + 1696 + 1200) * KIB


def test_buffers_held_before_the_step_push_it_into_larger_regions():
    events = [("alloc", "x", 1536 * KIB)]
    # Alone, 1.5 MiB gets the first region, 2 MiB, whole (2 < 2 x 1.5).
    assert allocator.peak_chunk_bytes(events) == 2 * MIB
    # A variable of 2 MiB fills that region first: 1.5 MiB splits the 4 MiB one.
    assert allocator.peak_chunk_bytes(events, held_before=[2 * MIB]) == 1536 * KIB
