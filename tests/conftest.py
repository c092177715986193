"""Shared fixtures: a per-test cluster of real agents that is always cleaned up."""

from __future__ import annotations

import os
import signal

import pytest

from tests.harness import Cluster

# A shell without job control starts background commands (`bash .ci/run &`) with SIGINT ignored,
# and exec'd children inherit that: the tests that send SIGINT to a worker they started directly
# would see it ignored.  A caught signal is reset to the default by exec, as an agent's is.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_PYTEST_PID = os.getpid()


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (a CI time limit, ``timeout``) unwinds the test like Ctrl-C, so its context managers
    and fixtures stop what it started: etcd members and agents run in sessions of their own, and
    a killed pytest would leave them running.  A forked child takes the default action."""
    if os.getpid() != _PYTEST_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"pytest got signal {signum}")


signal.signal(signal.SIGTERM, _terminated)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tests-phase", choices=("all", "concurrent", "serial"), default="all",
        help="tools/test.sh runs the suite in two phases: 'concurrent' (every test not marked serial, on "
             "several xdist workers), then 'serial' (the tests marked serial, one at a time, alone); "
             "default: all tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests of the phase asked for (``--tests-phase``); a serial mark must say why."""
    for item in items:
        mark = item.get_closest_marker("serial")
        if mark is not None and not (mark.args and isinstance(mark.args[0], str) and mark.args[0].strip()):
            raise pytest.UsageError(f"{item.nodeid}: pytest.mark.serial needs its reason: serial('why')")
    phase = config.getoption("--tests-phase")
    if phase == "all":
        return
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (keep if (item.get_closest_marker("serial") is not None) == (phase == "serial") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def agents(tmp_path):
    """A :class:`tests.harness.Cluster` whose processes are killed (by PID) after the test."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()
