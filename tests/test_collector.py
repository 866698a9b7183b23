"""core/collector.py: the cyclic collector is paused while the planner works,
and left as it was found. No TensorFlow graphs."""

import gc

import pytest

from memory_saving_gradients.core import collector


@pytest.fixture(autouse=True)
def _restore_collector():
    was_on = gc.isenabled()
    yield
    if was_on:
        gc.enable()
    else:
        gc.disable()


@collector.paused
def _collector_state(fail=False):
    if fail:
        raise RuntimeError("strategy failed")
    return gc.isenabled()


def test_paused_during_the_call_and_on_again_after():
    gc.enable()
    assert _collector_state() is False
    assert gc.isenabled()


def test_left_off_when_the_caller_had_turned_it_off():
    gc.disable()
    assert _collector_state() is False
    assert not gc.isenabled()


def test_on_again_after_an_exception():
    gc.enable()
    with pytest.raises(RuntimeError, match="strategy failed"):
        _collector_state(fail=True)
    assert gc.isenabled()


def test_nested_calls_turn_it_on_once_the_outer_call_ends():
    gc.enable()

    @collector.paused
    def outer():
        inner_state = _collector_state()
        return inner_state, gc.isenabled()

    assert outer() == (False, False)
    assert gc.isenabled()
