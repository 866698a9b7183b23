"""What the allocator holds at its measured peak beside the simulator's live set at its peak.

    python -m benchmarks.live_set_diff MODEL [--method memory] [--threads 1] [--top 25]
    python -m benchmarks.live_set_diff EfficientNetV2B0:96:32 --ranking "as taken"

MODEL: a name of `predicted_vs_measured.MODELS`, or "FAMILY:SIZE:BATCH" (e.g.
"MobileNetV2:64:112") for a model family at another size and batch.

Diagnostic for docs/planner.md: traces one step of a `predicted_vs_measured`
model, profiles one call (the profiler's allocator events: op, shape, bytes,
address, with TF_CPU_ALLOCATOR_USE_BFC=1), replays them in time order to the
peak, and prints the live buffers there grouped by op, then the timeline's
live keys at its own predicted peak, largest first. `--ranking held` or
`--ranking "as taken"` profiles the plan that ranking of the planner's candidates
takes first (`plan_objectives.first_of`) instead of a method's.
"""

import argparse
import collections
import os

# TensorFlow is imported inside the functions: `main` sets TF_CPU_ALLOCATOR_USE_BFC first.


def allocator_events(step, inputs, labels):
    """(time ps, +/-bytes, addr, op, shape, bytes requested) of one profiled call of `step`.

    The bytes are the allocator's chunk, which BFC does not split when the rest would be
    smaller than the request: a chunk can be up to twice the bytes requested.
    """
    import tensorflow as tf
    from memory_saving_gradients.tfgraph import profiled_allocations
    # The results are held until the trace stops: their buffers (the weight gradients)
    # are the ones the trace never frees (`returned_buffers`).
    held = []
    events = profiled_allocations.allocator_events(
        lambda: held.append(tf.nest.map_structure(lambda g: g, step(inputs, labels))))
    held.clear()
    return events


def requested_peak(events):
    """Peak over the call of the bytes requested (what the ops asked for, without BFC's
    chunk excess): the quantity the timeline predicts."""
    from memory_saving_gradients.tfgraph import profiled_allocations
    return profiled_allocations.requested_peak(events)


def measured_live_at_peak(events):
    """(peak bytes over the call, {addr: (bytes, op, shape, requested)} live at it)."""
    from memory_saving_gradients.tfgraph import profiled_allocations
    peak, at_peak = 0, {}
    for total, live in profiled_allocations.live_bytes(events, chunks=True):
        if total > peak:
            peak, at_peak = total, {addr: (events[index][1], *events[index][3:])
                                    for addr, (index, _) in live.items()}
    return peak, at_peak


def returned_buffers(events):
    """Indices in `events` of the allocations the call never frees: the step's results
    (its weight gradients), as `allocator_events` holds them until the trace ends."""
    open_at = {}
    for index, (_, size, addr, *_) in enumerate(events):
        if size > 0:
            open_at[addr] = index
        else:
            open_at.pop(addr, None)
    return frozenset(open_at.values())


def activation_peak(events, chunks=False):
    """Peak over the call of the bytes live but the step's results (`returned_buffers`),
    left out from their allocation on: the activations, their gradients and scratch at
    their most, wherever the weight gradients stand then. Bytes requested, or the
    allocator's chunks if `chunks`."""
    from memory_saving_gradients.tfgraph import profiled_allocations
    returned = returned_buffers(events)
    return max([0, *(total for total, _ in profiled_allocations.live_bytes(
        events, chunks, left_out=returned.__contains__))])


def predicted_live_at_peak(model, plan):
    """(peak, [(bytes, key)] alive at the simulator's peak step)."""
    from memory_saving_gradients.core import timeline
    replay = timeline._Replay(model, stock=plan is None)  # pylint: disable=protected-access
    replay.run(plan.levels if plan is not None else ())
    end = replay.step + 2
    totals = [0] * (end + 1)
    for key, (start, size) in replay.born.items():
        stop = min(replay.last_use[key], end - 1)
        for s in range(start, int(stop) + 1):
            totals[s] += size
    for s, size in replay.transient:
        totals[s] += size
    peak_step = max(range(end), key=totals.__getitem__)
    alive = [(size, key) for key, (start, size) in replay.born.items()
             if start <= peak_step <= replay.last_use[key] and size]
    alive += [(size, ("scratch",)) for s, size in replay.transient if s == peak_step and size]
    return totals[peak_step], sorted(alive, reverse=True), peak_step, replay.step


def main():
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--method", default="tf.gradients")
    parser.add_argument("--threads", default="default")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--ranking", choices=("held", "as taken"),
                        help="profile this ranking's first plan instead of --method's")
    args = parser.parse_args()
    from benchmarks import plan_objectives
    from benchmarks import predicted_vs_measured as pvm
    model, inputs, labels = pvm.model_and_data(args.model, args.threads)
    method = plan_objectives.first_of(args.ranking) if args.ranking else args.method
    traced = pvm._traced_step(model, inputs, labels, method, False)  # pylint: disable=protected-access
    plan = traced["plan"]
    events = allocator_events(traced["step"], inputs, labels)
    peak, live = measured_live_at_peak(events)
    requested = sum(buffer[3] for buffer in live.values())
    print(f"measured peak {peak / 2**20:.2f} MiB (with weight gradients), of which "
          f"{(peak - requested) / 2**20:.2f} MiB chunks beyond the bytes requested")
    print(f"bytes requested: peak {requested_peak(events) / 2**20:.2f} MiB, activation peak "
          f"{activation_peak(events) / 2**20:.2f} (weight gradients left out)")
    by_op = collections.Counter()
    for size, op, shape, _ in live.values():
        by_op[(op, shape)] += size
    for (op, shape), size in by_op.most_common(args.top):
        print(f"  {size / 2**20:8.3f}  {op}  {shape}")
    stock = method == "tf.gradients"
    total, alive, step, steps = predicted_live_at_peak(plan.model, None if stock else plan.plan)
    print(f"predicted peak {total / 2**20:.2f} MiB at step {step}/{steps}")
    for size, key in alive[:args.top]:
        print(f"  {size / 2**20:8.3f}  {key}")


if __name__ == "__main__":
    main()
