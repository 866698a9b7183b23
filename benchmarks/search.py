"""The max-batch search: doubling, then bisection, on measured peaks.

Pure Python; `peak(batch)` does the measuring (see `worker.measure_max_batch`).
"""


def max_batch(peak, cap, start, limit=1 << 16, resolution=0.0):
    """Largest batch with `peak(batch) <= cap`, to within `resolution` (relative).

    The default bisects down to one batch: the issue's targets are ratios of
    two searches' answers, and a 10% resolution could understate one by
    almost 10% (BERT: 128 fitted, 136 did not, 129-135 were never tried).

    Doubles from `start` while the batch fits (halves while it does not),
    then bisects between the largest batch that fit and the smallest that
    did not. `peak(batch)` returns bytes, or None when the step failed (counted
    as not fitting). Returns (best batch or 0, {batch: peak} of every probe).

    Example: with peak(b) = 10 * b and cap 1000, start 16 -> doubles 16, 32,
    64, 128 (too big), then bisects 96, 112, 104, 100, 98, 99 and returns 100;
    with resolution=0.1 it stops after 104 and returns 96.
    """
    probes = {}

    def fits(batch):
        if batch not in probes:
            probes[batch] = peak(batch)
        return probes[batch] is not None and probes[batch] <= cap

    lo, hi = 0, None  # lo fits (0: nothing fits yet), hi does not (None: none seen)
    batch = max(1, start)
    while True:  # bracket the answer: double while the batch fits, halve while not
        if fits(batch):
            lo = batch
            if hi is not None or batch >= limit:
                break
            batch = min(2 * batch, limit)
        else:
            hi = batch
            if lo or batch == 1:
                break
            batch //= 2
    if hi is None or lo == 0:  # the limit fits, or nothing does
        return lo, probes
    while hi - lo > max(1, resolution * lo):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes
