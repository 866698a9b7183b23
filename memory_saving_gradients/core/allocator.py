"""The chunks TensorFlow's BFC allocator hands out for a sequence of requests.

No TensorFlow. The measured peak of a step is the allocator's bytes in use:
the *chunks* it handed out, not the bytes requested. BFC (best-fit with
coalescing, tensorflow/core/common_runtime/bfc_allocator.cc) serves a request
from the smallest free chunk that holds it, and splits that chunk only when
the rest would be at least as large as the request: a 9 MiB weight gradient
may take a free 12 MiB chunk whole. Which chunks are free depends on what
the step allocated and freed before, so the slack is replayed, not guessed:
`chunk_peak` runs the step's allocations and frees through a model of BFC.

The model follows the allocator's rules: sizes rounded up to 256 bytes;
free chunks taken best-fit (smallest, then lowest address); a chunk split
when the rest is at least the request; a freed chunk merged with free
neighbours in its region; a new region when nothing fits, each region
(from 2 MiB) twice the size of the one before unless the request needs more
(`allow_growth`, as the CPU BFC allocator runs). The step is replayed once
to grow the regions as the warm-up calls did, then again on those regions,
all free, as a measured call finds them.
"""

from __future__ import annotations

import bisect
import os

_GRANULE = 256                 # BFC's kMinAllocationSize
_FIRST_REGION = 2 << 20        # allow_growth's first region
_MAX_WASTE = 128 << 20         # kMaxInternalFragmentation


def rounded(size: int) -> int:
    """`size` rounded up to the allocator's granule."""
    return -(-size // _GRANULE) * _GRANULE


class BestFitHeap:
    """Chunks over regions of addresses, as BFC keeps them.

    Chunks are (address, size); `free` is kept sorted by (size, address), which
    is the order BFC searches its bins in (bins only speed that search up).
    """

    def __init__(self):
        self.next_region = int(os.environ.get("PP_FIRST", _FIRST_REGION))
        self.region_end = {}  # region start -> end
        self.free = []        # sorted (size, address) of free chunks
        self.size_at = {}     # address -> size, of every chunk, used or free
        self.region_of = {}   # address -> start of its region
        self.free_end = {}    # end address -> address, of each free chunk
        self.in_use = 0       # bytes of the chunks handed out
        self.grew = False

    def allocate(self, size: int) -> int:
        """Address of the chunk that serves `size` bytes."""
        need = rounded(size)
        i = bisect.bisect_left(self.free, (need, -1))
        if i == len(self.free):
            self._extend(need)
            i = bisect.bisect_left(self.free, (need, -1))
        chunk, address = self.free[i]
        self._take_free(address)
        if chunk >= 2 * need or chunk - need >= _MAX_WASTE:
            self._add_free(address + need, chunk - need, self.region_of[address])
            chunk = need
        self.size_at[address] = chunk
        self.in_use += chunk
        return address

    def release(self, address: int) -> None:
        """Frees the chunk at `address`, merged with its free neighbours."""
        size = self.size_at[address]
        self.in_use -= size
        region = self.region_of[address]
        after = address + size
        if after < self.region_end[region] and self._is_free(after):
            self._take_free(after)
            size += self.size_at.pop(after)
            del self.region_of[after]
        before = self._free_before(address, region)
        if before is not None:
            self._take_free(before)
            del self.size_at[address], self.region_of[address]
            address, size = before, size + self.size_at[before]
        self._add_free(address, size, region)

    def _extend(self, need):
        while need > self.next_region:
            self.next_region *= 2
            grown = True
        else:
            grown = False
        start = max(self.region_end.values(), default=0)
        self.region_end[start] = start + self.next_region
        self._add_free(start, self.next_region, start)
        if not grown:
            self.next_region *= 2
        self.grew = True

    def _add_free(self, address, size, region):
        self.size_at[address] = size
        self.region_of[address] = region
        bisect.insort(self.free, (size, address))
        self.free_end[address + size] = address

    def _take_free(self, address):
        size = self.size_at[address]
        self.free.pop(bisect.bisect_left(self.free, (size, address)))
        del self.free_end[address + size]

    def _is_free(self, address):
        size = self.size_at.get(address)
        if size is None:
            return False
        i = bisect.bisect_left(self.free, (size, address))
        return i < len(self.free) and self.free[i] == (size, address)

    def _free_before(self, address, region):
        before = self.free_end.get(address)
        return before if before is not None and self.region_of[before] == region else None

    @property
    def _free_ends(self):
        if not hasattr(self, "_ends"):
            self._ends = {}
        return self._ends


def chunk_peak(events) -> int:
    """Peak bytes of chunks in use over `events`, replayed on warmed-up regions.

    `events`: (key, size) in the order the step makes them, `size` > 0 a
    request for the buffer `key`, `size` None the release of `key`'s buffer.
    Buffers not released stay in use to the end (returned results).
    """
    heap = BestFitHeap()
    for _ in range(3):  # until a replay finds every request a chunk in the regions
        heap.grew = False
        peak = _replay(heap, events)
        if not heap.grew:
            break
    return peak


def _replay(heap, events):
    held, peak = {}, 0
    for key, size in events:
        if size is None:
            heap.release(held.pop(key))
        else:
            held[key] = heap.allocate(size)
            peak = max(peak, heap.in_use)
    for address in held.values():  # the caller drops the results before the next call
        heap.release(address)
    return peak
