"""The allocator's events of one call, from TensorFlow's profiler: bytes requested.

A traced Session run's allocation records (`allocations.py`) give each
buffer's size as the allocator counts it. With TF_CPU_ALLOCATOR_USE_BFC=1
that is BFC's chunk, which is not split when the rest would be smaller than
the request: the same 24.5 MiB convolution scratch is recorded as 32 MiB in
one process state and 24.5 MiB in another. The profiler's MemoryAllocation
events carry the bytes requested beside the chunk, so a peak of requested
bytes depends on the ops alone.
"""

from __future__ import annotations

import glob
import logging
import tempfile

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat

logger = logging.getLogger(__name__)
_KINDS = {"MemoryAllocation": 1, "MemoryDeallocation": -1}
# How TensorFlow 2.16 names the op of an allocation no op made (a Session's
# feeds, which newer versions leave unnamed).
_NO_OP = "(null)"


def allocator_events(call) -> list:
    """(time ps, +/-chunk bytes, addr, op, shape, bytes requested) of the
    allocations `call()` makes, in time order (profiled; raises if another
    profiler session is running)."""
    events = []
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            call()
        finally:
            tf.profiler.experimental.stop()
        for path in glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[-1:]:
            for plane in compat.xspace_from_file(path).planes:
                events += _plane_events(plane)
    return sorted(events)


def _plane_events(plane):
    names = {k: v.name for k, v in plane.event_metadata.items()}
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    events = []
    for line in plane.lines:
        for event in line.events:
            sign = _KINDS.get(names.get(event.metadata_id))
            if sign is None:
                continue
            stats = {stat_names[s.metadata_id]: s for s in event.stats}
            size = _number(stats["allocation_bytes"])
            requested = _number(stats["requested_bytes"]) if "requested_bytes" in stats else size
            op, shape = (_text(plane, stats.get(key)) for key in ("tf_op", "shape"))
            op = "" if op == _NO_OP else op
            events.append((line.timestamp_ns * 1000 + event.offset_ps, sign * size,
                           _number(stats["addr"]), op, shape, requested))
    return events


def _number(stat):
    return stat.uint64_value or stat.int64_value


def _text(plane, stat):
    """A string stat's value, stored inline or interned in the plane's metadata."""
    if stat is None:
        return ""
    return plane.stat_metadata[stat.ref_value].name if stat.ref_value else stat.str_value


def live_bytes(events, chunks: bool = False, left_out=None):
    """Yields (bytes live, {addr: index in `events` of its allocation}) after
    each of `events`, from the start of the call: bytes requested, or BFC's
    chunks if `chunks`. Allocations `left_out(index)` names are not counted,
    nor are their frees. A free of a buffer made before the call (a variable's
    old value, replaced by an optimizer's or batch norm's assignment) lowers
    the count, as it lowers the allocator's current bytes: counting only the
    new value, an SGD step of 12 Dense + batch norm layers peaked at 14.85 MiB
    requested against an allocator peak of 8.5-9.0.
    """
    live, uncounted, total = {}, set(), 0
    for index, (_, size, addr, _, _, requested) in enumerate(events):
        amount = abs(size) if chunks else requested
        if size > 0 and left_out is not None and left_out(index):
            uncounted.add(addr)
        elif size > 0:
            live[addr] = (index, amount)
            total += amount
        elif addr in live:
            total -= live.pop(addr)[1]
        elif addr in uncounted:
            uncounted.discard(addr)
        else:
            total -= amount
        yield total, live


def requested_peak(events, ops_only: bool = False, scope: str = None) -> int:
    """Peak of the bytes requested over `events` (BFC's chunk excess left out),
    from the start of the call (`live_bytes`).

    ops_only: count only buffers an op allocated (not a Session's feeds,
    which the client converts before the run); frees match by address.
    scope: count only buffers of ops named under it (a probe's own graph,
    `allocations.probe_graph`), and only their frees: the profiler reports
    every thread's allocations, and a 0.5 MB probe read 4-8 MB while another
    thread made eager tensors (Keras's `fit` traces its step while its data
    pipeline allocates; a tf.distribute strategy's replicas trace at once).
    """
    if scope is not None:
        return max([0, *(total for total, _ in live_bytes(_made_in(events, scope)))])
    def feed(index):
        return not events[index][3]
    totals = live_bytes(events, left_out=feed if ops_only else None)
    return max([0, *(total for total, _ in totals)])


def _made_in(events, scope) -> list:
    """The allocations among `events` of ops under `scope`, and their frees (by
    address, in order). Ops Grappler makes from them keep the scope in their names."""
    own, kept = set(), []
    for event in events:
        size, addr, op = event[1], event[2], event[3]
        if size > 0 and _under(op, scope):
            own.add(addr)
            kept.append(event)
        elif size <= 0 and addr in own:
            own.discard(addr)
            kept.append(event)
    return kept


def _under(op: str, scope: str) -> bool:
    """Whether op name `op` has `scope` as one of its name segments' path
    (Grappler prefixes what it makes from an op: "ConstantFolding/probe3/x")."""
    return op.startswith(f"{scope}/") or f"/{scope}/" in op


def session_requested_peak(sess, fetches, feed_dict=None, scope=None):
    """Peak of the bytes the ops of one `sess.run` request (only those under
    `scope`, if given: `requested_peak`), or None when the profiler cannot run
    (another session is profiling) or reports no allocations of them (an
    allocator that emits no events: its records, the run's own, are exact)."""
    try:
        events = allocator_events(lambda: sess.run(fetches, feed_dict=feed_dict))
    except Exception as error:  # pylint: disable=broad-except  # the caller's records then
        logger.debug("profiled run failed: %s", error)
        return None
    if not any(op and (scope is None or _under(op, scope))
               for _, size, _, op, _, _ in events if size > 0):
        return None
    return requested_peak(events, ops_only=True, scope=scope)
