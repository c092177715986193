"""The short chaos form for CI: real agents, real workers, faults on a fixed seed, every invariant.

About 2 minutes on 2 cores: 8 mixed faults with c10d on loopback and a trainer that runs through
``et.run`` (survivors re-form in their process), the same with the model sharded by FSDP2, 4 with a
3-member etcd cluster and the plain training loop (every worker restarted), and (root only) a
partition across network namespaces, ``et.run`` again.  The long form is ``tools/chaos.py``, which
alternates the two trainers and the two models too.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.chaos import verify
from tests.chaos.faults import Fault
from tests.chaos.harness import JobSpec
from tests.chaos.run import reference_sha, run_job
from tests.evidence import EVIDENCE_ENV
from tests.rendezvous.etcd_cluster import etcd_available

pytestmark = pytest.mark.e2e

LOOPBACK = ("worker_kill", "worker_exit", "worker_hang", "agent_kill", "agent_term", "node_join", "slow_node")


@pytest.fixture
def reference(once):
    """The failure-free parameters of a chaos job's size, run once per test run for each size."""
    return lambda *size: once(("chaos reference", *size), lambda: reference_sha(*size))


def _check(result) -> None:
    assert result.ok, result.summary()
    assert all(f.logged for f in result.faults), result.summary()


def _check_kept(result) -> None:
    """Under ``et.run`` the survivors of a fault keep their process; each one that did not is
    explained by the agent (a ``reform_fallback`` event) or by its own exit."""
    survivors = sum(len(f.survivors) for f in result.faults)
    kept = sum(len(f.kept) for f in result.faults)
    assert survivors and kept * 2 >= survivors, result.summary()
    assert not [c for f in result.faults for c in f.fallbacks if c.endswith("no event names it")], result.summary()


def test_c10d_mixed_faults_through_et_run(reference):
    result = run_job(JobSpec(backend="c10d", seed=3, faults=8, kinds=LOOPBACK, reform=True), reference)
    _check(result)
    _check_kept(result)
    assert len(result.faults) >= 8
    assert len({f.kind for f in result.faults}) >= 4, result.summary()
    names = {c.name for c in result.checks}
    assert {"no committed step lost", "parameters bit-identical across the ranks of a group"} <= names


def test_c10d_mixed_faults_on_a_sharded_model_through_et_run(reference):
    """FSDP2: every rank snapshots its own shard and every change of the world size reshards the
    state from memory (the last layer leaves all ranks but one an empty shard); the same invariants."""
    result = run_job(JobSpec(backend="c10d", seed=3, faults=8, kinds=LOOPBACK, reform=True, sharded=True),
                     reference)
    _check(result)
    _check_kept(result)
    assert len({f.kind for f in result.faults}) >= 4, result.summary()
    assert {2, 3} <= set(result.worlds), result.summary()  # resharded both ways


@pytest.mark.etcd
@pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)")
def test_etcd_any_node_and_a_member_may_die(reference):
    kinds = ("worker_hang", "agent_kill", "etcd_kill", "node_join")
    result = run_job(JobSpec(backend="etcd", seed=2, faults=4, kinds=kinds), reference)
    _check(result)
    assert any(c.name == "no keys left in etcd" for c in result.checks)


@pytest.mark.netns
@pytest.mark.etcd
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="network namespaces need root and iproute2 (CI runs as root)")
@pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)")
def test_partitioned_node_across_namespaces(reference):
    """The survivors of a cut-off peer are blocked in a collective on a silent (not closed)
    connection: under ``et.run`` they must still leave it and keep their process."""
    result = run_job(JobSpec(backend="etcd", netns=True, seed=1, faults=2, kinds=("partition", "worker_kill"),
                             reform=True), reference)
    _check(result)
    _check_kept(result)
    assert "partition" in {f.kind for f in result.faults}, result.summary()


@pytest.mark.unit
def test_invariants_catch_a_reused_and_a_missing_sample():
    """The checks can fail: a step that re-used a sample, and an incomplete group."""
    steps = {1: [{"g": 0, "s": 1, "e": 0, "w": 2, "r": 0, "i": [0, 1], "h": "a"},
                 {"g": 0, "s": 1, "e": 0, "w": 2, "r": 1, "i": [1, 3], "h": "a"}]}
    once = verify.samples_once(steps, 4)
    assert not once.ok and "3 distinct" in once.detail
    steps[2] = [{"g": 1, "s": 2, "e": 1, "w": 2, "r": 0, "i": [0, 1]}]
    assert not verify.complete_steps(steps).ok


@pytest.mark.unit
def test_invariants_catch_a_lost_step_and_diverged_ranks():
    """The checks can fail: a restore behind a committed step, ranks whose parameters differ."""
    records = [{"g": 0, "s": s, "w": 2, "r": r} for s in range(1, 6) for r in (0, 1)]
    records.append({"g": 0, "s": 6, "w": 2, "r": 0})  # rank 1 never began step 6: step 3 is the newest for good
    assert verify.no_step_lost(records, [{"g": 1, "s": 3, "h": "x"}, {"g": 1, "s": 3, "h": "x"}]).ok
    lost = verify.no_step_lost(records, [{"g": 1, "s": 2, "h": "x"}, {"g": 1, "s": 3, "h": "x"}])
    assert not lost.ok and "step 3 had been committed" in lost.detail
    steps = {1: [{"g": 0, "s": 1, "r": 0, "h": "a"}, {"g": 0, "s": 1, "r": 1, "h": "b"}]}
    assert not verify.same_parameters(steps, []).ok
    assert not verify.same_parameters({}, [{"g": 2, "s": 5, "h": "a"}, {"g": 2, "s": 5, "h": "b"}]).ok
    ran = [{"g": 0, "s": 5, "r": 0, "h": "a"}, {"g": 1, "s": 5, "r": 0, "h": "b"}]  # step 5 redone by generation 1
    assert verify.same_parameters({}, [{"g": 2, "s": 5, "h": "b"}], ran).ok
    wrong = verify.same_parameters({}, [{"g": 2, "s": 5, "h": "a"}], ran)
    assert not wrong.ok and "generation 1 committed" in wrong.detail, wrong.detail


def test_faults_beyond_the_budget_fail_with_a_summary(tmp_path, monkeypatch, reference):
    """More failures than --max-restarts: the job stops and the result says why (no hang, nothing
    left), and the run's evidence is kept where the summary says."""
    monkeypatch.setenv(EVIDENCE_ENV, str(tmp_path))
    spec = JobSpec(backend="c10d", seed=5, faults=3, kinds=("worker_kill",), max_restarts=1, nodes=2)
    result = run_job(spec, reference)
    assert not result.ok
    finished = next(c for c in result.checks if c.name == "job finished")
    assert not finished.ok and "restart budget (--max-restarts=1) is spent" in finished.detail, result.summary()
    assert next(c for c in result.checks if c.name == "no orphan processes").ok, result.summary()
    assert result.evidence is not None and result.evidence.parent == tmp_path, result.summary()
    assert f"evidence kept: {result.evidence}" in result.summary()
    assert "job finished" in (result.evidence / "WHY.txt").read_text()
    assert list(result.evidence.glob("logs/events-*.jsonl")) and list(result.evidence.glob("data/steps.*.jsonl"))


def test_a_stall_is_a_violation_and_its_stacks_are_taken_before_anything_is_killed(tmp_path, monkeypatch, reference):
    """A worker hangs and its agent takes longer than the stall bound to see it: while the job is
    stalled the harness takes every process's stacks (they live on), then fails the stall invariant
    and keeps the work directory."""
    monkeypatch.setenv(EVIDENCE_ENV, str(tmp_path))
    result = run_job(JobSpec(backend="c10d", seed=1, faults=1, kinds=("worker_hang",), stall_after=1.5,
                             hang_timeout=5.0, nodes=2), reference)
    stall = next(c for c in result.checks if c.name == "steps again after every fault (no stall)")
    assert not stall.ok and "stall: no committed step for" in stall.detail, result.summary()
    assert result.evidence is not None, result.summary()
    kept = result.evidence
    assert "stall: no committed step for" in (kept / "WHY.txt").read_text()
    listed = (kept / "processes.txt").read_text()
    assert " stacks " in listed, listed  # agents and workers were asked for their stacks
    logs = "".join(p.read_text(errors="replace") for p in kept.glob("agent*.log"))
    assert "most recent call first" in logs and "elastrun/agent/agent.py" in logs, logs[-3000:]


@pytest.mark.unit
def test_the_stall_invariant_can_fail():
    fault = Fault("worker_kill", 1, 0.0, first_step=2.0)
    assert verify.steps_again([fault], 30.0, []).ok
    late = verify.steps_again([fault, Fault("agent_kill", 2, 0.0, first_step=None)], 30.0, [])
    assert not late.ok and "agent_kill@node2: never" in late.detail
    seen = verify.steps_again([fault], 30.0, ["12:00:00 stall: no committed step for 31 s"])
    assert not seen.ok and "stall" in seen.detail
    records = [{"t": t} for t in (100.0, 100.1, 100.2, 140.0, 140.1)]  # a stall nobody watched while it lasted
    gap = verify.steps_again([fault], 30.0, [], records)
    assert not gap.ok and "for 39.8 s" in gap.detail
    assert verify.steps_again([fault], 30.0, [], records[:3]).ok
