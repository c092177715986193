"""The job token: key derivation, sealing, token files, and real c10d/static jobs with and without it."""

from __future__ import annotations

import os
import time

import pytest

from elastrun.observe.status_view import read_status
from elastrun.rendezvous.api import RendezvousConfigError, RendezvousParameters
from elastrun.rendezvous.auth import TOKEN_ENV, JobToken, JobTokenRejected, hkdf_sha256, load_token
from tests.harness import base_env, free_port, listening, read_steps, wait_until

pytestmark = pytest.mark.e2e

TOKEN = "3f1c2b9a8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b"


def _token_file(tmp_path, text: str = TOKEN, mode: int = 0o600):
    path = tmp_path / "job.token"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


# ---------------------------------------------------------------------------------- derivation, sealing
@pytest.mark.unit
def test_hkdf_matches_rfc5869_test_case_1():
    okm = hkdf_sha256(bytes([0x0B] * 22), bytes(range(0x0D)), bytes(range(0xF0, 0xFA)), 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c"
                         "5db02d56ecc4c5bf34007208d5b887185865")


@pytest.mark.unit
def test_values_open_only_under_their_key_job_and_incarnation():
    token = JobToken(TOKEN.encode(), "job-a")
    marker = token.new_marker()
    auth = token.accept(marker, "here")
    reports = []
    auth.on_forged = lambda key, why: reports.append((key, why))
    key = auth.prefix + "r3/result"
    sealed = auth.seal(key, '{"x": 1}')
    assert auth.open(key, sealed.encode()) == '{"x": 1}'
    # Another key (round), a value without a tag, a flipped tag: ignored and reported once per key.
    assert auth.open(auth.prefix + "r4/result", sealed) is None
    assert auth.open(key, '{"x": 1}') is None
    assert auth.open(key, sealed[:-1] + ("A" if sealed[-1] != "A" else "B")) is None
    assert [k for k, _ in reports] == [auth.prefix + "r4/result", key]
    assert auth.rejected == 3
    # The same job id, another incarnation (nonce): another namespace, and old values do not open.
    again = token.accept(token.new_marker(), "here")
    assert again.prefix != auth.prefix and again.open(key, sealed) is None
    # Another job id with the same token: no value of job-a opens.
    other = JobToken(TOKEN.encode(), "job-b").accept(JobToken(TOKEN.encode(), "job-b").new_marker(), "here")
    assert other.open(key, sealed) is None
    # Lists: each line sealed on its own; forged lines are dropped, the rest kept in order.
    lkey = auth.prefix + "r3/gone_list"
    listing = auth.seal_line(lkey, "n1") + "n2\n" + auth.seal_line(lkey, "n3")
    assert auth.open_lines(lkey, listing) == ["n1", "n3"]


@pytest.mark.contract
def test_a_node_with_the_wrong_or_no_token_is_rejected():
    marker = JobToken(TOKEN.encode(), "j").new_marker()
    with pytest.raises(JobTokenRejected, match="^job token rejected: this node's token does not match"):
        JobToken(b"another token, long enough", "j").accept(marker, "h:1")
    with pytest.raises(JobTokenRejected, match="^job token rejected: job 'j' at h:1 requires a job token"):
        JobToken(None, "j").accept(marker, "h:1")
    with pytest.raises(JobTokenRejected, match="^job token rejected: job 'j' at h:1 runs without a job token"):
        JobToken(TOKEN.encode(), "j").accept("none", "h:1")
    assert not JobToken(None, "j").accept("none", "h:1").enabled
    assert issubclass(JobTokenRejected, RendezvousConfigError)  # the launcher exits 2 on it


@pytest.mark.unit
def test_token_file_checks(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    warnings: list[str] = []
    with pytest.raises(RendezvousConfigError, match="no such file; create it on every node"):
        load_token(str(tmp_path / "missing"))
    with pytest.raises(RendezvousConfigError, match="is not a regular file"):
        load_token(str(tmp_path))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(RendezvousConfigError, match="is empty; put a secret in it"):
        load_token(str(empty))
    assert load_token(str(_token_file(tmp_path)), warnings.append) == TOKEN.encode() and warnings == []
    assert load_token(str(_token_file(tmp_path, mode=0o644)), warnings.append) == TOKEN.encode()
    assert len(warnings) == 1 and "can be read by other users; run `chmod 600" in warnings[0]
    if os.geteuid() != 0:  # root reads any file
        _token_file(tmp_path, mode=0o000)
        with pytest.raises(RendezvousConfigError, match="cannot be read"):
            load_token(str(tmp_path / "job.token"))
    assert load_token(None) is None
    monkeypatch.setenv(TOKEN_ENV, "short")
    warnings.clear()
    assert load_token(None, warnings.append) == b"short" and "the job token is short" in warnings[0]


# ---------------------------------------------------------------------------------- real jobs
def _flags(port: int, run_id: str, tmp_path, extra: str = "") -> list[str]:
    conf = f"--rdzv-conf=token_file={_token_file(tmp_path)}" + (f",{extra}" if extra else "")
    return ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}", conf, f"--log-dir={tmp_path / 'logs'}"]


#: The status read without a token has a 3 s store timeout.  It once timed out under load instead of being refused
#: for its token, and the test ran alone since.  The likeliest cause, found later: the store's thread stalls 5 s
#: on a dropped reverse-DNS query (docs/testing.md, "Reverse DNS"), which tools/test.sh bounds at 1 s.  It runs
#: with the others again: 81 of 81 runs passed beside a full suite run (2026-11-27, 2 cores).
def test_c10d_job_with_a_token_admits_only_nodes_with_that_token(agents, tmp_path):
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="100000", STEP_SECONDS="0.05")
    env.pop(TOKEN_ENV, None)
    port = free_port()
    host = agents.start(_flags(port, "tok-c10d", tmp_path), env=env, name="host")
    wait_until(lambda: listening(port), 30, what="the store host to listen")
    wait_until(lambda: read_steps(steps_dir), 60, what="the host's first steps")

    # A wrong token and no token: one line, exit 2, at once; the job is not disturbed.
    bare = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=tok-c10d"]
    wrong = agents.start(bare, env={**env, TOKEN_ENV: "a different token of some length"}, name="wrong")
    none = agents.start(bare, env=env, name="none")
    for stranger in (wrong, none):
        started = time.monotonic()
        assert stranger.wait(60) == 2, stranger.output()
        lines = stranger.output().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("elastrun: error: job token rejected"), lines
        assert time.monotonic() - started < 30
    assert "this node's token does not match" in wrong.output() and "requires a job token" in none.output()

    # The right token from the environment (as from a Kubernetes Secret) joins: world 2.
    joined_at = time.time()
    right = agents.start(bare, env={**env, TOKEN_ENV: TOKEN}, name="right")
    wait_until(lambda: any(s.world == 2 and s.t > joined_at for s in read_steps(steps_dir)), 90,
               what="steps at world 2")

    # elastrun status needs the token: without it, one line and exit 2; with it, both nodes.
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "tok-c10d", 1, 1)
    with pytest.raises(JobTokenRejected, match="requires a job token"):
        read_status(params, 3.0)
    params.config = {"token_file": str(tmp_path / "job.token")}
    doc = read_status(params, 3.0)
    assert doc["world_size"] == 2 and {n["state"] for n in doc["nodes"]} == {"alive"}, doc
    pids = {int(n["node_id"].split("-")[-2]) for n in doc["nodes"]}
    assert pids == {host.pid, right.pid}
    assert host.proc.poll() is None and right.proc.poll() is None, agents.outputs()


def test_static_job_with_a_token(agents, tmp_path):
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="5", STEP_SECONDS="0.01")
    env.pop(TOKEN_ENV, None)
    port = free_port()
    conf = f"--rdzv-conf=token_file={_token_file(tmp_path)}"
    nodes = [
        agents.start(["--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}", "--master-addr=127.0.0.1",
                      f"--master-port={port}", conf], env=env, name=f"node{rank}")
        for rank in (1, 0)
    ]
    for node in nodes:
        assert node.wait(120) == 0, node.output()
    assert {(s.rank, s.world) for s in read_steps(steps_dir)} == {(0, 2), (1, 2)}


def test_workers_store_listens_only_on_the_agents_address(agents, tmp_path):
    """The rank-0 agent's store for the workers is bound to its rendezvous address, not 0.0.0.0."""
    import psutil

    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="100000", STEP_SECONDS="0.05")
    port = free_port()
    # Exec'd workers: /proc/PID/environ of a forked worker shows the template's start-up environment.
    host = agents.start(["--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d", "--start-method=spawn",
                         f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bind"], env=env)
    wait_until(lambda: read_steps(steps_dir), 60, what="first steps")
    master_port = int(_worker_env(host)["MASTER_PORT"])
    listeners = [c for c in psutil.Process(host.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == master_port]
    assert listeners and all(c.laddr.ip == "127.0.0.1" for c in listeners), listeners


def _worker_env(host) -> dict[str, str]:
    import psutil

    for child in psutil.Process(host.pid).children(recursive=True):
        try:
            env = child.environ()
        except psutil.Error:
            continue
        if "MASTER_PORT" in env and env.get("RANK") == "0":
            return env
    raise AssertionError("no worker with MASTER_PORT found")


def test_c10d_job_with_a_token_restarts_after_a_worker_failure(agents, tmp_path):
    """A later round under a token: authentic rejoins, failure records and finishes close it."""
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="30", STEP_SECONDS="0.02", CRASH_AT_STEP="10", CRASH_RANK="1",
                   CRASH_ONCE_FILE=str(tmp_path / "crashed"), CKPT=str(tmp_path / "ckpt.json"))
    env.pop(TOKEN_ENV, None)
    port = free_port()
    flags = [*_flags(port, "tok-restart", tmp_path), "--max-restarts=1"]
    flags[0] = "--nnodes=2"
    nodes = [agents.start(flags, env=env, name="host")]
    wait_until(lambda: listening(port), 30, what="the store host to listen")
    nodes.append(agents.start(flags, env=env, name="other"))
    for node in nodes:
        assert node.wait(120) == 0, node.output()
    steps = read_steps(steps_dir)
    assert {s.world for s in steps} == {2} and {s.gen for s in steps} == {"0", "1"}, steps
    assert max(s.step for s in steps if s.gen == "1") == 29
    assert "injected failure at step 10" in nodes[0].output() + nodes[1].output()
