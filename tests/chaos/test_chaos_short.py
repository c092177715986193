"""The short chaos form for CI: real agents, real workers, faults on a fixed seed, every invariant.

About 2 minutes on 2 cores: 8 mixed faults with c10d on loopback, 4 with a 3-member etcd cluster,
and (root only) a partition across network namespaces.  The long form is ``tools/chaos.py``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.chaos import verify
from tests.chaos.harness import JobSpec, run_job
from tests.rendezvous.etcd_cluster import etcd_available

LOOPBACK = ("worker_kill", "worker_exit", "worker_hang", "agent_kill", "agent_term", "node_join", "slow_node")


def _check(result) -> None:
    assert result.ok, result.summary()
    assert all(f.logged for f in result.faults), result.summary()


def test_c10d_mixed_faults():
    result = run_job(JobSpec(backend="c10d", seed=3, faults=8, kinds=LOOPBACK))
    _check(result)
    assert len(result.faults) >= 8
    assert len({f.kind for f in result.faults}) >= 4, result.summary()


@pytest.mark.etcd
@pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)")
def test_etcd_any_node_and_a_member_may_die():
    kinds = ("worker_hang", "agent_kill", "etcd_kill", "node_join")
    result = run_job(JobSpec(backend="etcd", seed=2, faults=4, kinds=kinds))
    _check(result)
    assert any(c.name == "no keys left in etcd" for c in result.checks)


@pytest.mark.netns
@pytest.mark.etcd
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="network namespaces need root and iproute2 (CI runs as root)")
@pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)")
def test_partitioned_node_across_namespaces():
    result = run_job(JobSpec(backend="etcd", netns=True, seed=1, faults=2, kinds=("partition", "worker_kill")))
    _check(result)
    assert "partition" in {f.kind for f in result.faults}, result.summary()


def test_invariants_catch_a_reused_and_a_missing_sample():
    """The checks can fail: a step that re-used a sample, and an incomplete group."""
    steps = {1: [{"g": 0, "s": 1, "e": 0, "w": 2, "r": 0, "i": [0, 1]},
                 {"g": 0, "s": 1, "e": 0, "w": 2, "r": 1, "i": [1, 3]}]}
    once = verify.samples_once(steps, 4)
    assert not once.ok and "3 distinct" in once.detail
    steps[2] = [{"g": 1, "s": 2, "e": 1, "w": 2, "r": 0, "i": [0, 1]}]
    assert not verify.complete_steps(steps).ok


def test_faults_beyond_the_budget_fail_with_a_summary():
    """More failures than --max-restarts: the job stops and the result says why (no hang, nothing left)."""
    result = run_job(JobSpec(backend="c10d", seed=5, faults=3, kinds=("worker_kill",), max_restarts=1))
    assert not result.ok
    finished = next(c for c in result.checks if c.name == "job finished")
    assert not finished.ok and "restart budget (--max-restarts=1) is spent" in finished.detail, result.summary()
    assert next(c for c in result.checks if c.name == "no orphan processes").ok, result.summary()
