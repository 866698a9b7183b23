"""The budget target's bookkeeping (benchmarks/budget_table.py, live_set_diff.requested_peak),
checked on hand-made rows and allocator events: no TensorFlow step runs here."""

from benchmarks.budget_table import table_line
from benchmarks.live_set_diff import activation_peak, measured_live_at_peak, requested_peak

MIB = 2 ** 20


def _event(time, size, addr, requested):
    return (time, size, addr, "op", "[1]", requested)


def test_requested_peak_leaves_out_the_chunk_excess():
    # A 9 MiB request served by a 12 MiB chunk (BFC splits a chunk only at twice the
    # request), a 1 MiB buffer freed before it, and a free of a buffer made before the call.
    events = [_event(0, 1 * MIB, 1, 1 * MIB), _event(1, -1 * MIB, 1, 1 * MIB),
              _event(2, 12 * MIB, 2, 9 * MIB), _event(3, 2 * MIB, 3, 2 * MIB),
              _event(4, -5 * MIB, 99, 5 * MIB)]
    assert requested_peak(events) == 11 * MIB
    assert measured_live_at_peak(events)[0] == 14 * MIB


def test_a_buffer_made_before_the_call_counts_its_release():
    # An assignment's new 2 MiB value, the old one (made before the call) freed, then a
    # 3 MiB request in a 4 MiB chunk, freed. Counting only the new value gave 5 MiB: an
    # optimizer's step measured 14.85 MiB requested against an allocator peak of 8.5-9.0.
    events = [_event(0, 2 * MIB, 1, 2 * MIB), _event(1, -2 * MIB, 99, 2 * MIB),
              _event(2, 4 * MIB, 2, 3 * MIB), _event(3, -4 * MIB, 2, 3 * MIB)]
    assert requested_peak(events) == 3 * MIB
    assert measured_live_at_peak(events)[0] == 4 * MIB
    assert activation_peak(events) == 1 * MIB  # the new value is a result: left out
    assert activation_peak(events, chunks=True) == 2 * MIB


def _row(measured, budget=10 * MIB, **extra):
    return {"model": "m", "threads": "1", "method": "budget0.5", "budget": budget,
            "predicted": 9 * MIB, "measured": measured, "measured_all": [measured], **extra}


def test_a_budget_is_met_up_to_15_percent_above_it():
    assert "| met |" in table_line(_row(11.4 * MIB))
    assert "**missed**" in table_line(_row(11.6 * MIB, requested=9 * MIB))
    assert "| 0.90 |" in table_line(_row(11.6 * MIB, requested=9 * MIB))


def test_an_infeasible_budget_shows_the_smallest_feasible_one():
    row = {"model": "m", "threads": "default", "method": "budget0.3",
           "error": "ValueError: no checkpoint plan fits a budget of 13.98 MiB (1 bytes): "
                    "the smallest feasible budget on this graph is 19.92 MiB (2 bytes)"}
    line = table_line(row)
    assert "infeasible (least 19.92 MiB)" in line and line.count("|") == 11
