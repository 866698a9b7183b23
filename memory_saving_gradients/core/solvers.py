"""Exact searches over the cut model (see `cuts`): least peak, or least recompute under a budget.

No TensorFlow. A plan is a path 0 = start < c1 < ... < ck through the candidate
cuts; the bytes kept, the bytes and cost recomputed in an interval all depend
on the interval's two ends only (`_Pairs`), and the peak is the largest of
(bytes kept so far, less the weight gradients not yet made, + bytes the
interval recomputes), the tail's included. So:

* `least_peak`: backwards over the cuts, the least peak of the rest of a plan
  starting at cut i is  f(i) = min(tail(i), min over j of K(i, j) +
  max(S(i, j), f(j))): exact in O(m^2) for m candidate cuts. Among the plans
  of that peak, the least recompute is `least_recompute` at that budget.
* `least_recompute`: a shortest path on recompute with kept bytes as a
  resource (a dynamic program over (cut, kept bytes in quanta), negative
  when more weight gradients are made than bytes kept); an interval
  may be taken only if the bytes kept so far plus its own recomputed bytes
  fit, and a plan may end at a cut only if its tail fits. Exact when the
  quantum is 1 byte; otherwise kept bytes are rounded up per interval, so the
  plan always fits and may keep slightly less than it could. O(m^2 * Q).
"""

import dataclasses

import numpy as np

from memory_saving_gradients.core import cuts as cut_model

MAX_QUANTA = 512  # resolution of kept bytes in the budgeted search
NEGATIVE_QUANTA = 2  # least_recompute tracks kept totals exactly down to -2 * quanta quanta
PLAN_SLACKS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)  # low_peak_plans: budgets above the least peak


@dataclasses.dataclass(frozen=True)
class Solution:
    """A set of cuts and what the cut model says of it."""
    cuts: tuple
    cost: cut_model.Cost


class _Pairs:
    """Kept bytes K, recomputed held bytes S and cost C of every interval between two cuts.

    Index 0 is the start (a cut before the first op), i >= 1 the candidate
    cut i - 1. K[i, j], S[i, j], C[i, j] describe the interval (i, j], i < j;
    tail[i] the held bytes after cut i. Built with 2-D prefix sums in O(n + m^2).
    """

    def __init__(self, problem: cut_model.CutProblem):
        self.at = np.concatenate([[-1], problem.cuts]).astype(np.int64)
        self._free = ~problem.always_kept
        pos = np.arange(len(problem.ops))[self._free]
        # Interval of each op: at[u - 1] < pos <= at[u]; alive across cut j iff u <= j < v.
        self._u = np.searchsorted(self.at, pos, side="left")
        self._v = np.searchsorted(self.at, problem.last_use[self._free], side="left")
        made, totals = self.internal(problem.op_bytes)
        # Kept bytes less the weight gradients the interval makes (`cuts`): may be negative.
        weights = np.concatenate([[0], np.cumsum(problem.op_weights)])[self.at + 1]
        self.K = (totals[None, :-1] - totals[:-1, None] - made
                  - (weights[None, :] - weights[:, None]))
        self.S, held = self.internal(problem.op_held)
        # An interval's own weight gradients are made while it is differentiated:
        # beside its recomputed bytes they are not yet counted as made.
        self.S = self.S + (weights[None, :] - weights[:, None])
        self.C, _ = self.internal(problem.op_cost)
        self.tail = held[-1] - held[:-1]
        # The tail after cut i recomputes its ops that pinned tensors are rebuilt from.
        rerun = np.concatenate([[0], np.cumsum(np.where(problem.op_rerun, problem.op_cost, 0))])
        self.tail_cost = rerun[-1] - rerun[self.at + 1]
        self.fixed = problem.fixed_bytes
        self.weights = weights[-1]  # up to the last cut

    def internal(self, weights):
        """Per pair (i, j): summed weights of the ops in (i, j] not alive across j;
        and per i, the summed weights of the ops up to cut i (last: of all)."""
        m = len(self.at)
        flat = np.bincount(self._u * (m + 1) + self._v, np.asarray(weights, float)[self._free],
                           minlength=(m + 1) ** 2)
        hist = flat.reshape(m + 1, m + 1)
        below = np.cumsum(np.cumsum(hist, axis=1), axis=0)  # u <= i, v <= j
        inside = np.diagonal(below)[None, :m] - below[:m, :m]
        return np.triu(inside, 1), np.cumsum(hist.sum(axis=1))

    def cuts_of(self, path):
        return tuple(int(self.at[j]) for j in path if j > 0)


def _allowed(pairs, forbidden):
    """Intervals a plan may use: i < j, and recomputing none of the `forbidden` ops."""
    m = len(pairs.at)
    ok = np.triu(np.ones((m, m), bool), 1)
    return ok if forbidden is None else ok & (pairs.internal(forbidden)[0] <= 0)


def least_peak(problem, forbidden=None) -> Solution:
    """The cuts of least peak; among those, least recompute.

    `forbidden`: a boolean per op; intervals that would recompute one of them
    are not used (the tail and kept tensors may hold them).
    """
    pairs = _Pairs(problem)
    allowed = _allowed(pairs, forbidden)
    m = len(pairs.at)
    rest = pairs.tail.astype(float)  # f(i): least peak from cut i on, fixed bytes aside
    nxt = np.full(m, -1)             # the cut after i on that plan (-1: the tail)
    for i in range(m - 2, -1, -1):
        later = np.flatnonzero(allowed[i])
        if len(later):
            through = pairs.K[i, later] + np.maximum(pairs.S[i, later], rest[later])
            k = int(np.argmin(through))
            if through[k] < rest[i]:
                rest[i], nxt[i] = through[k], later[k]
    path = [0]
    while nxt[path[-1]] >= 0:
        path.append(int(nxt[path[-1]]))
    least = Solution(pairs.cuts_of(path), cut_model.evaluate(problem, pairs.cuts_of(path)))
    cheaper = least_recompute(problem, least.cost.peak_bytes, forbidden=forbidden, pairs=pairs)
    return cheaper or least  # None only when quanta round the least peak's plan out


def low_peak_plans(problem, forbidden=None, count=8) -> list:
    """Up to `count` distinct plans, least cut-model peak first (ties: least recompute).

    The least-peak plan, then the least-recompute plans under budgets a little
    above its peak: they trade kept bytes against recomputed bytes
    differently, which the cut model prices alike and the timeline does not
    (see `strategies`).
    """
    least = least_peak(problem, forbidden)
    found = {least.cuts: least}
    for slack in PLAN_SLACKS[:max(count - 1, 0)]:
        plan = least_recompute(problem, least.cost.peak_bytes * (1 + slack), forbidden=forbidden)
        if plan is not None:
            found.setdefault(plan.cuts, plan)
    return sorted(found.values(), key=lambda p: (p.cost.peak_bytes, p.cost.recompute))[:count]


def least_recompute(problem, budget: float, quanta: int = MAX_QUANTA, forbidden=None,
                    pairs=None):
    """The cuts of least recompute whose cut-model peak is at most `budget`, or None.

    Kept bytes (less the weight gradients made, so a running total may be
    negative) are counted in quanta of ceil(room / quanta) bytes (room: the
    budget minus the bytes always kept), rounded up per interval; with
    quanta >= room the search is exact. Ties: fewer kept quanta.
    `forbidden` as in `least_peak`.
    """
    pairs = pairs or _Pairs(problem)
    room = budget - pairs.fixed  # negative when weight gradients pay for more than is kept
    quantum = max(1.0, np.ceil(room / quanta))
    steps = int(room // quantum)
    # Quanta below zero the running total may reach (weight gradients made beyond
    # the bytes kept); lower totals are counted as this one, which only overestimates.
    low = int(min(np.ceil(pairs.weights / quantum), NEGATIVE_QUANTA * quanta))
    if steps < -low:
        return None
    need = np.ceil(pairs.K / quantum).astype(np.int64)
    # Highest kept quanta after taking (i, j] such that they and S(i, j) fit.
    top = np.floor((room - pairs.S) / quantum)
    allowed = _allowed(pairs, forbidden) & (top >= need - low)
    best, back, source = _budget_paths(pairs, allowed, need,
                                       np.minimum(top, steps).astype(np.int64),
                                       max(steps, 0), low)
    kept = np.arange(-low, max(steps, 0) + 1)[None, :] * quantum
    score = np.where(kept + pairs.tail[:, None] <= room, best + pairs.tail_cost[:, None],
                     np.inf)
    if not np.isfinite(score).any():
        return None
    end, at = min(zip(*np.nonzero(score == score.min())), key=lambda found: found[1])
    path, at = [int(end)], int(at)
    while path[-1] > 0:
        j = path[-1]
        path.append(int(back[j, at]))
        at = int(source[j, at])
    found = pairs.cuts_of(path)
    return Solution(found, cut_model.evaluate(problem, found))


def _budget_paths(pairs, allowed, need, top, steps, low):
    """Per cut j and kept quanta q (index q + low): least cost of a path to j keeping
    exactly q quanta, the cut before j on it, and the index it came from there.

    One pass per allowed interval (i, j], on slices of the quanta it leaves room for.
    """
    m, width = len(pairs.at), low + steps + 1
    best = np.full((m, width), np.inf)
    back = np.zeros((m, width), np.int32)
    source = np.zeros((m, width), np.int32)
    best[0, low] = 0.0
    for j in range(1, m):
        for i in np.flatnonzero(allowed[:j, j]):
            shift = int(need[i, j])
            end = min(width, int(top[i, j]) - shift + low + 1)  # indices at i that fit
            came = best[i, :end] + pairs.C[i, j]
            first = max(0, -shift)  # indices below land under the lowest: counted as it
            if first > 0 and end > 0:
                k = int(np.argmin(came[:first]))
                _improve(best, back, source, j, slice(0, 1), came[k:k + 1], i, np.array([k]))
            if end > first:
                _improve(best, back, source, j, slice(first + shift, end + shift), came[first:],
                         i, np.arange(first, end))
    return best, back, source


def _improve(best, back, source, j, into, came, i, indices):
    """Takes the costs `came` (from cut i, at `indices`) where they beat best[j, into]."""
    better = came < best[j, into]
    best[j, into][better] = came[better]
    back[j, into][better] = i
    source[j, into][better] = indices[better]
