"""``elastrun status`` against a live two-node c10d job: before and after a node loss, text and --json."""

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
from elastrun.rendezvous import registry
from elastrun.rendezvous.api import RendezvousParameters, StatusNotSupportedError
from tests import warm
from tests.harness import REPO, alive, base_env, free_port, listening, read_steps, wait_until

pytestmark = pytest.mark.e2e


def _status_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-m", "elastrun", "status", *args], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=timeout)


def _read(endpoint: str, run_id: str) -> dict:
    return read_status(RendezvousParameters("c10d", endpoint, run_id, 1, 1), 3.0)


def test_status_of_a_two_node_job_before_and_after_a_node_loss(agents, tmp_path):
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="100000", STEP_SECONDS="0.05")
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    flags = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
             "--rdzv-id=obs-status", "--max-restarts=2", f"--log-dir={tmp_path / 'logs'}"]
    host = agents.start(flags, env=env, name="host")
    wait_until(lambda: listening(port), 30, what="the store host to listen")
    other = agents.start(flags, env=env, name="other")
    wait_until(lambda: any(s.world == 2 for s in read_steps(steps_dir)), 90, what="steps at world 2")

    # Text: the round, both nodes with address, state, ranks and a fresh heartbeat; the budget.
    text = _status_cli(f"--rdzv-endpoint={endpoint}", "--rdzv-id=obs-status")
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "job obs-status (c10d at 127.0.0.1:" in out and ": running, round" in out, out
    assert "world size 2" in out and "restarts: 0 used, 2 left (--max-restarts=2)" in out, out
    rows = [line for line in out.splitlines() if f"-{host.pid}-" in line or f"-{other.pid}-" in line]
    assert len(rows) == 2, out
    for row in rows:
        assert "127.0.0.1" in row and " alive " in row and " s ago" in row, row
    assert {row.split()[4] for row in rows} == {"0", "1"}, out  # RANKS column

    # JSON: one document with the same facts, for scripts.
    js = _status_cli(f"--rdzv-endpoint={endpoint}", "--rdzv-id=obs-status", "--json")
    assert js.returncode == 0, js.stderr
    doc = json.loads(js.stdout)
    assert doc["state"] == "running" and doc["world_size"] == 2 and doc["max_restarts"] == 2
    assert doc["restarts_left"] == 2
    by_pid = {int(n["node_id"].split("-")[-2]): n for n in doc["nodes"]}
    assert set(by_pid) == {host.pid, other.pid}
    assert all(n["state"] == "alive" and 0 <= n["heartbeat_age"] < 5 for n in doc["nodes"])
    assert sorted(n["ranks"][0] for n in doc["nodes"]) == [0, 1]
    round_before = doc["round"]

    # Lose the non-host node: its agent and its workers go at once, as with a dead machine.
    victims = other.descendants()
    other.kill(signal.SIGKILL)
    for pid in alive(victims):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    lost_at = time.time()

    # While the survivor notices, status may show the lost node as silent or lost; then a new round.
    def one_node_round():
        d = _read(endpoint, "obs-status")
        return d if d["round"] is not None and d["round"] > round_before and len(d["nodes"]) == 1 else None

    wait_until(one_node_round, 60, interval=0.3, what="a new round with one node")
    wait_until(lambda: any(s.world == 1 and s.t > lost_at for s in read_steps(steps_dir)), 60,
               what="the survivor stepping at world 1")
    after = json.loads(_status_cli(f"--rdzv-endpoint={endpoint}", "--rdzv-id=obs-status", "--json").stdout)
    assert after["round"] > round_before and after["world_size"] == 1, after
    assert [int(n["node_id"].split("-")[-2]) for n in after["nodes"]] == [host.pid], after
    assert after["nodes"][0]["state"] == "alive"
    text = _status_cli(f"--rdzv-endpoint={endpoint}", "--rdzv-id=obs-status")
    assert text.returncode == 0 and "world size 1" in text.stdout, text.stdout + text.stderr
    assert f"-{other.pid}-" not in text.stdout
    assert host.proc.poll() is None, agents.outputs()

    # With the job's --log-dir: goodput so far.  This script sends neither step records nor heartbeats,
    # so it is not measured (docs/observe.md); the node loss is a fault all the same.
    text = _status_cli(f"--rdzv-endpoint={endpoint}", "--rdzv-id=obs-status", f"--log-dir={tmp_path / 'logs'}")
    assert text.returncode == 0 and "\ngoodput not measured" in text.stdout, text.stdout + text.stderr
    js = json.loads(_status_cli(f"--rdzv-endpoint={endpoint}", "--rdzv-id=obs-status", "--json",
                                f"--log-dir={tmp_path / 'logs'}").stdout)
    assert js["goodput"]["live"] is True and js["goodput"]["basis"] == "none", js["goodput"]
    kinds = [f["kind"] for f in js["goodput"]["faults"]]
    assert kinds in (["node_lost"], ["join", "node_lost"]), js["goodput"]  # the second node may join a round late


def test_status_of_a_missing_job_or_store_is_one_line_and_exit_1(agents, tmp_path):
    # Nothing listens on this port: a one-line error, answered before torch is even imported.
    dead = free_port()
    res = _status_cli(f"--rdzv-endpoint=127.0.0.1:{dead}", "--rdzv-id=nope")
    assert res.returncode == 1, res
    assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "cannot reach the rendezvous store" in res.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom elastrun.observe.cli import main\n"
         f"code = main(['status', '--rdzv-endpoint=127.0.0.1:{dead}', '--rdzv-id=nope'])\n"
         "print(code, 'torch' in sys.modules)"],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=30)
    assert probe.stdout.split() == ["1", "False"], probe

    # A store that answers but holds no such job: a one-line error naming the run id.
    port = free_port()
    env = base_env(STEPS_LOG=str(tmp_path), STEPS="100000", STEP_SECONDS="0.05")
    agents.start(["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=real-job"], env=env)
    wait_until(lambda: listening(port), 30, what="the store host to listen")
    res = _status_cli(f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=other-job", "--json")
    assert res.returncode == 1, res
    assert len(res.stderr.strip().splitlines()) == 1 and "no job 'other-job'" in res.stderr, res.stderr


def _handler_without_status(params):  # a backend registered as a bare factory: no status reader
    raise AssertionError("status must not create a handler")


def test_status_of_a_backend_without_a_reader_says_so(monkeypatch):
    # Registered for this test only: other tests list every known backend.
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    registry.register("obs-test-nostatus", _handler_without_status)
    with pytest.raises(StatusNotSupportedError, match="does not support 'elastrun status'"):
        read_status(RendezvousParameters("obs-test-nostatus", "127.0.0.1:1", "x", 1, 1))
    res = _status_cli("--rdzv-backend=nosuch", "--rdzv-id=x")
    assert res.returncode == 2 and "unknown rendezvous backend 'nosuch'" in res.stderr, res.stderr
