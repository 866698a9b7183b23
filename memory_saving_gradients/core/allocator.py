"""The bytes TensorFlow's CPU allocator counts: a best-fit-with-coalescing replay.

No TensorFlow. With ``TF_CPU_ALLOCATOR_USE_BFC=1`` TensorFlow 2.21's CPU
allocator is a BFC allocator (process_state.cc: ``allow_growth = true``, a
64 GiB limit, no garbage collection, default fragmentation rule), and its
``bytes_in_use`` / ``peak`` count the CHUNK each request gets, not the bytes
requested. This module replays allocations and frees under the same rules
(bfc_allocator.cc) and reports the peak of chunk bytes in use:

- a request is rounded up to a multiple of 256 bytes;
- it takes the smallest free chunk that fits (ties: the lowest address);
- that chunk is split (the request at its start, the rest stays free) only
  if it is at least twice the rounded request, or the rest is at least
  128 MiB; otherwise the whole chunk is handed out and counted;
- a freed chunk merges with free neighbours of the same region;
- when no free chunk fits, a new region is taken: its size starts at 2 MiB
  and doubles until the request fits; a region that was big enough without
  doubling doubles the size of the next one.

Region addresses are unknown (they come from malloc); regions taken later
are assumed to lie at higher addresses, which only decides ties.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

GRANULE = 256  # bytes: every chunk is a multiple of this
FIRST_REGION_BYTES = 2 << 20
SPLIT_ANYWAY_BYTES = 128 << 20  # a remainder this big is split off however small the request


def rounded(size: int) -> int:
    """`size` bytes rounded up to the allocator's 256-byte granule."""
    return -(-size // GRANULE) * GRANULE


@dataclasses.dataclass(eq=False)
class _Chunk:
    region: int
    offset: int
    size: int
    in_use: bool = False
    prev: "_Chunk | None" = None
    next: "_Chunk | None" = None

    def sort_key(self):
        """Order of the free list: size, then address (unique among free chunks)."""
        return (self.size, self.region, self.offset)


class BestFitAllocator:
    """A simulated BFC allocator: `allocate` / `free` by the caller's keys.

    Attributes:
      in_use_bytes: bytes of the chunks handed out now.
      peak_bytes: most `in_use_bytes` since creation or `reset_peak`.
    """

    def __init__(self):
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self._free = []  # sort keys of the free chunks, sorted
        self._chunk_of_key = {}  # sort key -> free chunk
        self._held = {}  # caller's key -> chunk handed out
        self._next_region_bytes = FIRST_REGION_BYTES
        self._regions = 0

    def allocate(self, key, size: int) -> int:
        """Hands out a chunk for `size` bytes under `key`; returns the chunk's size."""
        if size <= 0:
            return 0
        need = rounded(size)
        chunk = self._best_fit(need) or self._new_region(need)
        self._unlist(chunk)
        if chunk.size >= 2 * need or chunk.size - need >= SPLIT_ANYWAY_BYTES:
            self._split(chunk, need)
        chunk.in_use = True
        self._held[key] = chunk
        self.in_use_bytes += chunk.size
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return chunk.size

    def free(self, key) -> None:
        """Returns the chunk under `key` (nothing if `key` holds none)."""
        chunk = self._held.pop(key, None)
        if chunk is None:
            return
        self.in_use_bytes -= chunk.size
        chunk.in_use = False
        for neighbour in (chunk.prev, chunk.next):
            if neighbour is not None and not neighbour.in_use:
                self._unlist(neighbour)
                chunk = _merged(chunk, neighbour)
        self._list(chunk)

    def reset_peak(self) -> None:
        """Starts a new peak from the bytes in use now (as reset_memory_stats does)."""
        self.peak_bytes = self.in_use_bytes

    def _best_fit(self, need):
        # BFC searches size-class bins upwards, each sorted by (size, address):
        # the first fit there is the first fit of one list sorted the same way.
        at = bisect.bisect_left(self._free, (need,))
        return self._chunk_of_key[self._free[at]] if at < len(self._free) else None

    def _new_region(self, need):
        grown = False
        while self._next_region_bytes < need:
            self._next_region_bytes *= 2
            grown = True
        chunk = _Chunk(self._regions, 0, self._next_region_bytes)
        self._regions += 1
        if not grown:
            self._next_region_bytes *= 2
        self._list(chunk)
        return chunk

    def _split(self, chunk, need):
        rest = _Chunk(chunk.region, chunk.offset + need, chunk.size - need,
                      prev=chunk, next=chunk.next)
        if chunk.next is not None:
            chunk.next.prev = rest
        chunk.next, chunk.size = rest, need
        self._list(rest)

    def _list(self, chunk):
        key = chunk.sort_key()
        bisect.insort(self._free, key)
        self._chunk_of_key[key] = chunk

    def _unlist(self, chunk):
        key = chunk.sort_key()
        del self._free[bisect.bisect_left(self._free, key)]
        del self._chunk_of_key[key]


def _merged(chunk, neighbour):
    """The free chunk `chunk` and its free neighbour make (neighbour unlisted)."""
    first, second = (neighbour, chunk) if neighbour.next is chunk else (chunk, neighbour)
    first.size += second.size
    first.next = second.next
    if second.next is not None:
        second.next.prev = first
    return first


def lifetime_events(born, last_use, transient, pieces=None):
    """Buffers with lifetimes as allocator events, in time order.

    born: key -> (step, bytes); last_use: key -> the last step it is read
    (infinite: held to the end); transient: (step, bytes) of scratch alive
    during one step; pieces: key -> n for a key that stands for n equal
    buffers with one lifetime (a loop's per-iteration stacks), allocated one
    by one. Within a step the op's outputs are allocated first, then
    its scratch (allocated and freed while it runs), then the buffers it read
    for the last time are freed: TensorFlow's executor drops an op's inputs
    after the op has computed (and allocated) its outputs. Buffers held to
    the end get no free (`peak_chunk_bytes` frees them after the replay);
    0-byte buffers (aliases) allocate nothing.
    """
    timed = []
    for key, (step, whole) in born.items():
        count = (pieces or {}).get(key, 1)
        for number, size in enumerate(_split(whole, count)):
            piece = (key, number) if count > 1 else key
            timed.append((step, 0, len(timed), ("alloc", piece, size)))
            if last_use[key] != math.inf:
                timed.append((last_use[key], 2, len(timed), ("free", piece)))
    for number, (step, size) in enumerate(transient):
        key = ("scratch", number)
        timed.append((step, 1, len(timed), ("alloc", key, size)))
        timed.append((step, 1, len(timed), ("free", key)))
    timed.sort(key=lambda item: item[:3])
    return [item[3] for item in timed]


def _split(size: int, count: int) -> list:
    """`size` bytes as `count` near-equal nonzero parts (none for 0 bytes)."""
    if not size:
        return []
    count = max(1, min(count, size))
    return [size // count + (1 if number < size % count else 0) for number in range(count)]


def peak_chunk_bytes(events, held_before=(), warm_up: bool = True) -> int:
    """Peak of chunk bytes in use over `events`, ("alloc", key, size) / ("free", key),
    above the bytes in use when the measured replay starts.

    held_before: sizes of buffers allocated before the step and held through
    it (a model's variables): they take the first regions, so the step's
    allocations start in the larger regions the allocator grows next.
    warm_up: replay the events once first and measure the second replay, as
    benchmarks measure a traced step after warm-up calls: the regions the
    first call grew are there, and a free chunk handed out whole to a request
    of more than half its size is part of what the allocator counts. Keys
    still held at the end of a replay are freed (the caller drops the step's
    outputs).
    """
    allocator = BestFitAllocator()
    for number, size in enumerate(held_before):
        allocator.allocate(("held before", number), size)
    for _ in range(2 if warm_up else 1):
        allocator.reset_peak()
        start = allocator.in_use_bytes
        _replay(allocator, events)
        peak = allocator.peak_bytes - start
    return peak


def _replay(allocator, events):
    held = set()
    for event in events:
        if event[0] == "alloc":
            allocator.allocate(event[1], event[2])
            held.add(event[1])
        else:
            allocator.free(event[1])
            held.discard(event[1])
    for key in held:
        allocator.free(key)
