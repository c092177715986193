"""``elastrun status --rdzv-backend etcd`` against a real etcd and a live two-node job (real agents
and gloo workers): text and --json before and after one agent is SIGKILLed, a missing job, and
unreachable endpoints."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from elastrun.observe.status_view import read_status
from elastrun.rendezvous.api import JobNotFoundError, RendezvousConnectionError, RendezvousParameters
from tests import warm
from tests.harness import REPO, alive, base_env, free_port, read_steps, wait_until
from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.etcd,
    pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)"),
]

RUN_ID = "obs-etcd"


def _status_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-m", "elastrun", "status", "--rdzv-backend=etcd", *args], cwd=REPO,
                          env=base_env(), capture_output=True, text=True, timeout=timeout)


def _read(endpoints: str, run_id: str = RUN_ID) -> dict:
    return read_status(RendezvousParameters("etcd", endpoints, run_id, 1, 1), 3.0)


def _pid_of(node_id: str) -> int:
    return int(node_id.split("-")[-2])  # node ids are HOST-PID-SUFFIX


def test_status_of_a_two_node_etcd_job_before_and_after_an_agent_goes_silent(agents, tmp_path):
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="100000", STEP_SECONDS="0.05")
    with EtcdCluster(1) as etcd:
        flags = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd.endpoints}",
                 f"--rdzv-id={RUN_ID}", "--max-restarts=2", "--monitor-interval=0.1"]
        first = agents.start(flags, env=env, name="first")
        second = agents.start(flags, env=env, name="second")
        wait_until(lambda: any(s.world == 2 for s in read_steps(steps_dir)), 90, what="steps at world 2")
        wait_until(lambda: _read(etcd.endpoints)["state"] == "running", 10, what="status 'running'")

        # Text: the round, both nodes with address, ranks, state and a lease-based heartbeat; the budget.
        keys_before = etcd.list_keys()
        text = _status_cli(f"--rdzv-endpoint={etcd.endpoints}", f"--rdzv-id={RUN_ID}")
        assert text.returncode == 0, text.stderr
        out = text.stdout
        assert f"job {RUN_ID} (etcd at {etcd.endpoints}): running, round" in out, out
        assert "world size 2" in out and "restarts: 0 used, 2 left (--max-restarts=2)" in out, out
        rows = [line for line in out.splitlines() if f"-{first.pid}-" in line or f"-{second.pid}-" in line]
        assert len(rows) == 2, out
        for row in rows:
            assert "127.0.0.1" in row and " alive " in row and " s ago" in row, row
        assert {row.split()[4] for row in rows} == {"0", "1"}, out  # RANKS column

        # JSON: the c10d document's fields, plus the incarnation and each agent lease's TTL.
        js = _status_cli(f"--rdzv-endpoint={etcd.endpoints}", f"--rdzv-id={RUN_ID}", "--json")
        assert js.returncode == 0, js.stderr
        doc = json.loads(js.stdout)
        assert doc["backend"] == "etcd" and doc["state"] == "running" and doc["world_size"] == 2, doc
        assert doc["agents"] == 2 and doc["max_restarts"] == 2 and doc["restarts_left"] == 2, doc
        assert doc["incarnation"] and doc["waiting"] == [] and doc["aborted"] is None, doc
        assert {_pid_of(n["node_id"]) for n in doc["nodes"]} == {first.pid, second.pid}, doc
        for node in doc["nodes"]:
            assert node["state"] == "alive" and node["lease_ttl"] == 3, node
            assert 1 <= node["lease_ttl_left"] <= 3 and 0 <= node["heartbeat_age"] <= 2, node
        assert sorted(n["ranks"][0] for n in doc["nodes"]) == [0, 1]
        round_before = doc["round"]

        # A pure client: reading wrote nothing (same keys, same etcd revision).
        assert etcd.list_keys() == keys_before
        assert _read(etcd.endpoints)["revision"] == doc["revision"]

        # Silence the first agent (it closed the round and hosts the workers' store), workers with it:
        # SIGSTOP, so its liveness link stays open and only its lease can tell (a SIGKILLed agent is
        # declared dead from its closed link at once, often before any status read could see it).
        victims = [first.pid, *first.descendants()]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()

        # Until the survivor forms a new round, the victim's lease runs out: silent, then lost.
        seen: set[str] = set()

        def new_round():
            d = _read(etcd.endpoints)
            if d["round"] == round_before:
                seen.update(n["state"] for n in d["nodes"] if _pid_of(n["node_id"]) == first.pid)
                return None
            return d if d["round"] is not None and len(d["nodes"]) == 1 else None

        wait_until(new_round, 60, interval=0.1, what="a new round with one node")
        assert seen & {"silent", "lost"}, f"the stopped agent never showed as silent or lost: {seen}"
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        first.proc.wait(10)
        wait_until(lambda: not alive(victims), 10, what="the stopped processes to go")
        wait_until(lambda: any(s.world == 1 and s.t > stopped_at for s in read_steps(steps_dir)), 60,
                   what="the survivor stepping at world 1")
        after = json.loads(_status_cli(f"--rdzv-endpoint={etcd.endpoints}", f"--rdzv-id={RUN_ID}", "--json").stdout)
        assert after["round"] > round_before and after["world_size"] == 1 and after["state"] == "running", after
        assert [_pid_of(n["node_id"]) for n in after["nodes"]] == [second.pid], after
        assert after["nodes"][0]["state"] == "alive" and after["nodes"][0]["group_rank"] == 0, after
        assert after["incarnation"] == doc["incarnation"], "a lost agent must not start a new incarnation"
        text = _status_cli(f"--rdzv-endpoint={etcd.endpoints}", f"--rdzv-id={RUN_ID}")
        assert text.returncode == 0 and "world size 1" in text.stdout, text.stdout + text.stderr
        assert f"-{first.pid}-" not in text.stdout
        assert second.proc.poll() is None, agents.outputs()


def test_etcd_status_of_a_missing_job_or_unreachable_etcd_is_one_line_and_exit_1():
    # No etcd listens at either endpoint: one line naming both, at once.
    dead = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    res = _status_cli(f"--rdzv-endpoint={dead}", "--rdzv-id=nope")
    assert res.returncode == 1 and res.stdout == "", res
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "cannot reach etcd at" in res.stderr and all(e in res.stderr for e in dead.split(",")), res.stderr
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="cannot reach etcd"):
        _read(dead, "nope")
    assert time.monotonic() - started < 15  # a clear error, not a hang

    # etcd answers but holds no such job: one line naming the run id.
    with EtcdCluster(1) as etcd:
        res = _status_cli(f"--rdzv-endpoint={etcd.endpoints}", "--rdzv-id=other-job", "--json")
        assert res.returncode == 1 and res.stdout == "", res
        assert len(res.stderr.strip().splitlines()) == 1 and "no job 'other-job'" in res.stderr, res.stderr
        with pytest.raises(JobNotFoundError, match="other-job"):
            _read(etcd.endpoints, "other-job")
        assert etcd.list_keys() == [], "status must not write to etcd"
