"""Shared fixtures: a per-test cluster of real agents that is always cleaned up."""

from __future__ import annotations

import signal

import pytest

from tests.harness import Cluster

# A shell without job control starts background commands (`bash .ci/run &`) with SIGINT ignored,
# and exec'd children inherit that: the tests that send SIGINT to a worker they started directly
# would see it ignored.  A caught signal is reset to the default by exec, as an agent's is.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def agents(tmp_path):
    """A :class:`tests.harness.Cluster` whose processes are killed (by PID) after the test."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()
