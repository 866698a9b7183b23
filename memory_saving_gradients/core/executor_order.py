"""The order TensorFlow's executor runs a graph in: a simulation of its ready queue.

No TensorFlow. What the executor does (tensorflow/core/common_runtime/executor.cc,
`ExecutorState::ScheduleReady` and `Process`; Eigen's NonBlockingThreadPool):

- When an op finishes, the successors it makes ready form a list, in the order
  of the op's out-edges. Cheap ops of the list join the running thread's
  inline queue (first in, first out). Of the expensive ops, all but the last
  are handed to the inter-op pool; the last one is run inline too if the
  inline queue is empty, else it is handed to the pool as well.
- A thread of the pool keeps the tasks it handed over itself at the front of
  its own queue and takes its next task from that front (last in, first out);
  an idle thread steals from the back of another thread's queue.

With one inter-op thread this runs a chain of expensive ops depth first and
defers every op it handed over until the chain stops (nothing it finishes
makes an op ready): a weight gradient that is not the last of its list waits
until then, holding what it reads. With two threads the other thread steals
those ops at once and runs them beside the chain.

The out-edge order is the one thing this cannot know from the op-level graph:
TensorFlow's is that of the optimized graph (grappler, then the oneDNN
rewrite), and measured traces show it differing between identical layers of
one model. `simulate` takes the order as given (the successor lists), so a
caller states which order it assumes. Deterministic: ties go to the lower
thread number.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Ran:
    """One op's run: which thread, when it started and finished (in cost units)."""
    op: str
    thread: int
    start: float
    finish: float


def simulate(successors: Mapping[str, Sequence[str]], cost: Mapping[str, float],
             expensive: Mapping[str, bool], threads: int = 1) -> list:
    """Runs the graph `successors` (op -> its out-edges' ops, in order) as the executor.

    `cost`: time each op takes; `expensive`: whether the executor hands it to the
    pool (TensorFlow's kernels are expensive on CPU unless they say otherwise,
    and a kernel measured under a few microseconds becomes cheap). Returns the
    runs in the order they started (`Ran`).
    """
    waiting = {op: 0 for op in cost}
    for op in cost:
        for s in successors.get(op, ()):
            waiting[s] += 1
    queues = [collections.deque() for _ in range(threads)]  # per thread: front = its next task
    # The roots are handed to the pool by the caller (not a worker): at the back.
    for op in cost:
        if waiting[op] == 0:
            queues[0].append(op)
    inline = [collections.deque() for _ in range(threads)]
    busy = []  # heap of (finish time, thread, op)
    idle = set(range(threads))
    now, runs = 0.0, []

    def start(thread, op):
        runs.append(Ran(op, thread, now, now + cost[op]))
        heapq.heappush(busy, (now + cost[op], thread, op))
        idle.discard(thread)

    def next_task(thread):
        """The thread's next op: its inline queue, its own queue's front, or a steal."""
        if inline[thread]:
            return inline[thread].popleft()
        if queues[thread]:
            return queues[thread].popleft()
        for other in range(threads):
            if queues[other]:
                return queues[other].pop()
        return None

    def dispatch():
        for thread in sorted(idle):
            op = next_task(thread)
            if op is not None:
                start(thread, op)

    dispatch()
    while busy:
        now, thread, op = heapq.heappop(busy)
        idle.add(thread)
        ready = []
        for s in successors.get(op, ()):
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
        last = None
        for s in ready:
            if not expensive.get(s, True):
                inline[thread].append(s)
            else:
                if last is not None:
                    queues[thread].appendleft(last)
                last = s
        if last is not None:
            if inline[thread]:
                queues[thread].appendleft(last)
            else:
                inline[thread].append(last)
        dispatch()
    return runs
