"""The max-batch search of the benchmarks (pure Python, no TensorFlow)."""

from benchmarks import search


def _linear(per_example):
    return lambda batch: per_example * batch


def test_the_default_search_finds_the_exact_largest_batch():
    best, probes = search.max_batch(_linear(10), 1000, 16)
    assert best == 100
    assert 101 in probes and probes[101] > 1000


def test_a_coarser_resolution_stops_early():
    best, _ = search.max_batch(_linear(10), 1000, 16, resolution=0.1)
    assert best == 96


def test_a_failed_probe_counts_as_not_fitting():
    best, _ = search.max_batch(lambda b: None if b > 130 else b, 1000, 128)
    assert best == 130


def test_the_limit_caps_the_search():
    best, probes = search.max_batch(_linear(1), 1000, 16, limit=64)
    assert best == 64 and max(probes) == 64
