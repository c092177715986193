"""End-to-end tests of the etcd backend: real etcd servers, real agents, real DDP workers (gloo)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available
from tests.rendezvous.etcd_job import kill_group, read_steps, start_agent, wait_for, world_steps

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.etcd,
    pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)"),
]


@pytest.fixture
def agents():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        kill_group(proc)


def _log(tmp_path, name: str) -> str:
    return (tmp_path / name).read_text(errors="replace")


def test_member_killed_mid_training_job_goes_on(tmp_path, agents):
    steps = tmp_path / "steps"
    steps.mkdir()
    with EtcdCluster(3) as cluster:
        for i in range(2):
            agents.append(start_agent(cluster.endpoints, "ha", steps, tmp_path / f"a{i}.log", nnodes="2:3",
                                      steps=200))
        wait_for(lambda: len(world_steps(read_steps(steps), 2)) >= 20, 60, "training at world 2")
        cluster.kill(0)  # the member every agent talks to first
        killed_at = time.time()
        codes = [p.wait(90) for p in agents]
        assert codes == [0, 0], _log(tmp_path, "a0.log") + _log(tmp_path, "a1.log")
        rows = read_steps(steps)
        assert world_steps(rows, 2, after=killed_at + 5), "training did not go on at world 2"
        assert {r["gen"] for r in rows} == {"0"}, "losing one etcd member must not restart the workers"
        assert cluster.list_keys() == []


def test_first_agent_lost_survivors_go_on(tmp_path, agents):
    steps = tmp_path / "steps"
    steps.mkdir()
    with EtcdCluster(1) as cluster:
        first = start_agent(cluster.endpoints, "loss", steps, tmp_path / "a0.log", nnodes="2:3", steps=100000)
        agents.append(first)
        time.sleep(1.0)  # the first agent joins first (and closes the first round)
        for i in (1, 2):
            agents.append(start_agent(cluster.endpoints, "loss", steps, tmp_path / f"a{i}.log", nnodes="2:3",
                                      steps=100000))
        wait_for(lambda: len(world_steps(read_steps(steps), 3)) >= 10, 90, "training at world 3")
        kill_group(first)
        killed_at = time.time()
        wait_for(lambda: len(world_steps(read_steps(steps), 2, after=killed_at)) >= 10, 60,
                 "the survivors training at world 2")
        assert all(p.poll() is None for p in agents[1:]), "a survivor exited"
        assert "node(s) lost" in _log(tmp_path, "a1.log") + _log(tmp_path, "a2.log")


def test_two_jobs_on_one_etcd_do_not_interfere(tmp_path, agents):
    with EtcdCluster(1) as cluster:
        dirs = []
        for job in ("jobA", "jobB"):
            steps = tmp_path / job
            steps.mkdir()
            dirs.append(steps)
            agents.append(start_agent(cluster.endpoints, job, steps, tmp_path / f"{job}.log", nnodes="1:2",
                                      steps=30))
        codes = [p.wait(90) for p in agents]
        assert codes == [0, 0], _log(tmp_path, "jobA.log") + _log(tmp_path, "jobB.log")
        for steps in dirs:
            rows = read_steps(steps)
            assert {r["world"] for r in rows} == {1} and {r["rank"] for r in rows} == {0}
            assert max(r["step"] for r in rows) == 29
        assert cluster.list_keys() == []


def test_etcd_down_then_back_workers_keep_training(tmp_path, agents):
    """Two agents train at world 2 through an etcd outage longer than the lease TTL: the workers are never
    restarted, the job ends with exit 0 on both nodes and leaves no key.  (It is also the plain two-agent job
    on etcd, once a test of its own.)"""
    steps = tmp_path / "steps"
    steps.mkdir()
    with EtcdCluster(1) as cluster:
        for i in range(2):
            agents.append(start_agent(cluster.endpoints, "outage", steps, tmp_path / f"a{i}.log", nnodes="2:3",
                                      steps=260))
        wait_for(lambda: len(world_steps(read_steps(steps), 2)) >= 20, 60, "training at world 2")
        cluster.kill(0)
        down_at = time.time()
        time.sleep(4.0)  # longer than the lease TTL
        during = [r for r in read_steps(steps) if down_at + 1 < r["t"] < down_at + 4]
        cluster.restart(0)
        codes = [p.wait(90) for p in agents]
        logs = _log(tmp_path, "a0.log") + _log(tmp_path, "a1.log")
        assert codes == [0, 0], logs
        assert len(during) >= 10, "the workers stopped training while etcd was down"
        assert "etcd unreachable" in logs and "reachable again" in logs
        rows = read_steps(steps)
        assert {r["gen"] for r in rows} == {"0"}, "an etcd outage must not restart the workers"
        assert {r["world"] for r in rows} == {2}
        assert max(r["step"] for r in rows) == 259
        assert cluster.list_keys() == []


def _enable_auth(cluster: EtcdCluster) -> None:
    import json
    import urllib.request

    for path, body in (("auth/user/add", {"name": "root", "password": "right"}),
                       ("auth/user/grant", {"user": "root", "role": "root"}), ("auth/enable", {})):
        request = urllib.request.Request(f"http://{cluster.endpoint(0)}/v3/{path}", data=json.dumps(body).encode())
        urllib.request.urlopen(request, timeout=5).read()


def test_wrong_password_is_a_clear_error(tmp_path):
    with EtcdCluster(1) as cluster:
        _enable_auth(cluster)
        argv = [sys.executable, "-m", "elastrun", "--nnodes=1", "--rdzv-backend=etcd",
                f"--rdzv-endpoint={cluster.endpoints}", "--rdzv-id=auth",
                "--rdzv-conf=username=root,password=wrong", "--no-python", "true"]
        started = time.monotonic()
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                             env=_env())
        assert out.returncode == 2, out.stderr
        assert "refused the credentials" in out.stderr and "password" in out.stderr
        assert time.monotonic() - started < 30


def test_unreachable_etcd_at_start_names_the_endpoints(tmp_path):
    from tests.harness import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "elastrun", "--nnodes=1", "--rdzv-backend=etcd", f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=down", "--rdzv-conf=join_timeout=2", "--no-python", "true"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 1, out.stderr
    assert endpoint in out.stderr and "could not reach etcd" in out.stderr


def _env() -> dict[str, str]:
    import os

    from tests.rendezvous.etcd_job import REPO

    return dict(os.environ, PYTHONPATH=str(REPO))


def test_sigterm_during_outage_is_not_a_hang(tmp_path, agents):
    """An agent told to stop while etcd is down still exits (its clean-up gives up, bounded)."""
    steps = tmp_path / "steps"
    steps.mkdir()
    with EtcdCluster(1) as cluster:
        agents.append(start_agent(cluster.endpoints, "stop", steps, tmp_path / "a0.log", nnodes="1"))
        wait_for(lambda: len(read_steps(steps)) >= 5, 60, "training")
        cluster.kill(0)
        agents[0].send_signal(signal.SIGTERM)
        assert agents[0].wait(60) == 128 + signal.SIGTERM


def test_crash_loop_stops_the_job_with_do_not_requeue(tmp_path, agents):
    """The crash-loop verdict works on etcd too: exit 3 long before the budget, and no keys left."""
    steps = tmp_path / "steps"
    steps.mkdir()
    with EtcdCluster(1) as cluster:
        agents.append(start_agent(cluster.endpoints, "loop", steps, tmp_path / "a0.log", nnodes="1:2",
                                  max_restarts=10,
                                  extra_env={"CRASH_AT_STEP": "0", "CRASH_RANK": "0", "PET_CRASH_LOOP_LIMIT": "2"}))
        assert agents[0].wait(120) == 3, _log(tmp_path, "a0.log")
        out = _log(tmp_path, "a0.log")
        assert "crash loop (2 failed attempts in a row without progress" in out
        assert "RuntimeError: injected failure at step 0" in out
        assert cluster.list_keys() == []
