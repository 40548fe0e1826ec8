"""Spin before blocking (sbpflow/comm/spin.py): the first non-empty poll within the budget, a
spent budget or a zero one gives [], a late yield (a busy task took the core) pauses every
spin of the process for PAUSE_S, and SBPFLOW_SPIN_US sets the budget."""

import time

import pytest

from sbpflow.comm import spin
from sbpflow.errors import CommError


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch):
    monkeypatch.setattr(spin, "_resume_at", 0.0)


def _polls(answers):
    calls = []

    def poll():
        calls.append(1)
        return answers[len(calls) - 1] if len(calls) <= len(answers) else []
    return poll, calls


class _Clock:
    """A perf_counter that moves only when told: a loaded machine (CI under xdist) can delay
    a real yield past LATE_S, which would pause the spin this test watches."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now

    def sched_yield(self):
        self.now += 1e-6


def test_the_first_non_empty_poll_is_returned(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(spin, "time", clock)
    monkeypatch.setattr(spin.os, "sched_yield", clock.sched_yield)
    poll, calls = _polls([[], [], [(3, 1)]])
    assert spin.spin_poll(poll, 1.0) == [(3, 1)]
    assert len(calls) == 3


def test_a_zero_budget_does_not_poll_and_a_spent_one_gives_nothing(monkeypatch):
    poll, calls = _polls([])
    assert spin.spin_poll(poll, 0.0) == [] and not calls
    clock = _Clock()  # (a real yield delayed past LATE_S under load would end the spin early)
    monkeypatch.setattr(spin, "time", clock)
    monkeypatch.setattr(spin.os, "sched_yield", clock.sched_yield)
    assert spin.spin_poll(poll, 0.002) == []
    # a poll a yield of 1 µs: polled until the 2 ms were spent, then one look more at most
    assert 0.002 <= clock.now - 100.0 < 0.00201 and 2000 <= len(calls) <= 2002


def test_a_late_yield_pauses_spinning_for_the_process(monkeypatch):
    monkeypatch.setattr(spin.os, "sched_yield", lambda: time.sleep(2 * spin.LATE_S))
    monkeypatch.setattr(spin, "PAUSE_S", 0.2)
    poll, calls = _polls([])
    assert spin.spin_poll(poll, 1.0) == []  # one late yield: a last look, then the caller blocks
    assert len(calls) == 2
    assert spin.spin_poll(poll, 1.0) == [] and len(calls) == 2  # paused: no poll at all
    time.sleep(0.25)
    monkeypatch.setattr(spin.os, "sched_yield", lambda: None)
    poll, calls = _polls([[], [1]])
    assert spin.spin_poll(poll, 1.0) == [1]  # the pause is over


@pytest.mark.parametrize("raw, budget", [(None, spin.DEFAULT_SPIN_US / 1e6), ("0", 0.0),
                                         ("500", 0.0005), (" 20000 ", 0.02)])
def test_the_budget_comes_from_the_environment(monkeypatch, raw, budget):
    if raw is None:
        monkeypatch.delenv("SBPFLOW_SPIN_US", raising=False)
    else:
        monkeypatch.setenv("SBPFLOW_SPIN_US", raw)
    assert spin.spin_budget() == pytest.approx(budget)


@pytest.mark.parametrize("raw", ["fast", "-1", "nan"])
def test_a_bad_budget_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv("SBPFLOW_SPIN_US", raw)
    with pytest.raises(CommError, match="SBPFLOW_SPIN_US"):
        spin.spin_budget()
