"""Shared fixtures: a per-test cluster of real agents that is always cleaned up."""

from __future__ import annotations

import pytest

from tests.harness import Cluster


@pytest.fixture
def agents(tmp_path):
    """A :class:`tests.harness.Cluster` whose processes are killed (by PID) after the test."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()
