"""benchmarks.recompute_floor on a hand-made model (no TF graph): the least recompute
found at each memory share falls as the share grows, and starts from "memory"."""

from benchmarks import recompute_floor
from memory_saving_gradients.core import strategies
from test_selection import chain_model


def test_floor_falls_with_the_share_and_starts_at_memory():
    model, _ = chain_model(100)
    memory = strategies.memory(model)
    rows = recompute_floor.floor_rows(model, memory, shares=(0.2, 0.4, 0.6, 1.0))
    baseline = memory.estimate.baseline_bytes
    assert rows[0][1:] == (memory.peak_bytes / baseline,
                           memory.recompute_flops / memory.estimate.forward_flops)
    fits = [(share, recompute) for _, share, recompute in rows[1:]]
    assert all(s is not None for s, _ in fits)
    assert all(s <= limit for (s, _), limit in zip(fits, (0.2, 0.4, 0.6, 1.0)))
    recomputes = [r for _, r in fits]
    assert recomputes == sorted(recomputes, reverse=True) and recomputes[-1] < recomputes[0]
    assert recomputes[0] <= rows[0][2]  # "memory" fits at 0.2: nothing above it
