"""The join gate's decisions (:func:`elastrun.agent.join_gate.defer_join`): a real pipe stands for the
starter's readiness, a function for the rendezvous' answer; the agents' own use is in test_membership."""

from __future__ import annotations

import os
import threading
import time

import pytest

from elastrun.agent.join_gate import defer_join
from elastrun.rendezvous.api import RendezvousConnectionError

pytestmark = pytest.mark.unit


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def _answers(*values):
    """A rendezvous that answers ``values`` in turn, then the last one for ever; counts the questions."""
    asked = []

    def interrupts() -> bool:
        asked.append(time.monotonic())
        value = values[min(len(asked) - 1, len(values) - 1)]
        if isinstance(value, Exception):
            raise value
        return value

    return interrupts, asked


def test_nothing_to_wait_for_or_nothing_to_interrupt_joins_at_once(pipe):
    r, w = pipe
    interrupts, asked = _answers(True)
    assert defer_join(interrupts, None) is None, "a starter with nothing pending (exec workers)"
    assert not asked
    os.write(w, b"x")
    assert defer_join(interrupts, r) is None, "the starter is ready already"
    assert not asked, "the rendezvous was asked although the node was ready"
    os.read(r, 1)
    calm, asked = _answers(False)
    assert defer_join(calm, r) is None, "a job's first round, or a round forming"
    assert len(asked) == 1
    failing, _ = _answers(RendezvousConnectionError("store gone"))
    assert defer_join(failing, r) is None, "a rendezvous that does not answer: the join reports it"
    garbled, _ = _answers(ValueError("invalid literal for int()"))
    assert defer_join(garbled, r) is None, "a backend's own error: the gate only saves time, it joins"


def test_a_join_that_would_interrupt_waits_for_the_starter_and_says_so_once(pipe):
    r, w = pipe
    interrupts, asked = _answers(True)
    waits = []
    threading.Timer(0.3, os.write, (w, b"ready")).start()
    deferral = defer_join(interrupts, r, on_wait=lambda: waits.append(1), poll=0.02)
    assert deferral is not None and deferral.ended_by == "ready"
    assert 0.25 <= deferral.waited < 5.0, deferral
    assert waits == [1]
    assert len(asked) >= 3, "the rendezvous was not asked again while the node waited"
    assert os.read(r, 16) == b"ready", "the gate read the starter's message"


def test_a_round_that_starts_forming_ends_the_wait_at_once(pipe):
    r, _ = pipe
    interrupts, asked = _answers(True, True, True, False)
    deferral = defer_join(interrupts, r, poll=0.01)
    assert deferral is not None and deferral.ended_by == "round forming"
    assert len(asked) == 4


def test_the_wait_is_bounded_and_a_rendezvous_error_ends_it(pipe):
    r, _ = pipe
    interrupts, _ = _answers(True)
    deferral = defer_join(interrupts, r, poll=0.02, limit=0.2)
    assert deferral is not None and deferral.ended_by == "limit"
    assert 0.2 <= deferral.waited < 5.0
    failing, _ = _answers(True, RendezvousConnectionError("store gone"))
    deferral = defer_join(failing, r, poll=0.01)
    assert deferral is not None and deferral.ended_by == "rendezvous error"
