"""Every mistaken flag or value, run through the real ``python -m elastrun`` command.

Each case must end with exit status 2, exactly one stderr line ``elastrun: error: ...`` that says
what is wrong, no traceback, and nothing started: the training script did not run (it would
create a marker file), no log directory was created, and no process of the run is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from elastrun.rendezvous.registry import known_backends

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MARKER_ENV = "ELASTRUN_CLI_TEST_MARKER"

# (id, argv, extra environment, words the error line must contain).  "SCRIPT" stands for a real
# training script, "MISSING" for a path that does not exist.
# fmt: off
CASES = [
    ("nnodes-min-above-max", ["--nnodes=3:1", "SCRIPT"], {}, ["--nnodes=3:1", "MIN (3) is greater than MAX"]),
    ("nnodes-zero", ["--nnodes=0", "SCRIPT"], {}, ["--nnodes=0", "at least 1 node"]),
    ("nnodes-junk", ["--nnodes=a:b", "SCRIPT"], {}, ["--nnodes=a:b", "MIN:MAX"]),
    ("nnodes-three-parts", ["--nnodes=1:2:3", "SCRIPT"], {}, ["--nnodes=1:2:3", "MIN:MAX"]),
    ("nnodes-from-env", ["SCRIPT"], {"PET_NNODES": "3:1"}, ["PET_NNODES=3:1", "MIN (3)"]),
    ("nproc-zero", ["--nproc-per-node=0", "SCRIPT"], {}, ["--nproc-per-node=0", "positive integer, auto"]),
    ("nproc-negative", ["--nproc_per_node", "-2", "SCRIPT"], {}, ["--nproc_per_node=-2", "positive integer"]),
    ("nproc-junk", ["--nproc-per-node=many", "SCRIPT"], {}, ["--nproc-per-node=many", "auto, cpu or gpu"]),
    ("unknown-backend", ["--rdzv-backend=zookeeper", "SCRIPT"], {}, ["--rdzv-backend=zookeeper", "known:"]),
    ("endpoint-extra-part", ["--rdzv-backend=c10d", "--rdzv-endpoint=host:29400:x", "SCRIPT"], {},
     ["--rdzv-endpoint=host:29400:x", "HOST[:PORT]"]),
    ("endpoint-port-range", ["--rdzv-backend=c10d", "--rdzv-endpoint=host:65536", "SCRIPT"], {}, ["1-65535"]),
    ("endpoint-port-zero-remote", ["--rdzv-backend=c10d", "--rdzv-endpoint=node1:0", "SCRIPT"], {},
     ["localhost only"]),
    ("endpoint-list-not-etcd", ["--rdzv-backend=c10d", "--rdzv-endpoint=h1:1,h2:2", "SCRIPT"], {}, ["etcd"]),
    ("missing-script", ["MISSING"], {}, ["not found", "-m MODULE"]),
    ("missing-program", ["--no-python", "no-such-program-3f2a"], {}, ["no-such-program-3f2a", "executable"]),
    ("no-script", [], {}, ["no training script"]),
    ("module-and-no-python", ["-m", "--no-python", "json.tool"], {}, ["exclude each other"]),
    ("bad-module-name", ["-m", "not a module"], {}, ["not a module name"]),
    ("max-restarts-negative", ["--max-restarts=-1", "SCRIPT"], {}, ["--max-restarts=-1", ">= 0"]),
    ("monitor-interval-zero", ["--monitor-interval=0", "SCRIPT"], {}, ["--monitor-interval=0", "> 0"]),
    ("node-rank-outside", ["--nnodes=2", "--node-rank=2", "SCRIPT"], {}, ["--node-rank=2", "[0, 2)"]),
    ("redirects-bad", ["--redirects=0:7", "SCRIPT"], {}, ["--redirects=0:7", "LOCAL_RANK:0-3"]),
    ("tee-bad", ["-t", "x", "SCRIPT"], {}, ["-t x", "0-3"]),
    ("master-port-range", ["--master-port=70000", "SCRIPT"], {}, ["--master-port=70000", "1-65535"]),
    ("master-port-zero", ["--master-port", "0", "SCRIPT"], {}, ["--master-port=0", "1-65535"]),
    ("static-elastic-range", ["--nnodes=1:2", "SCRIPT"], {}, ["static backend needs a fixed node count"]),
    ("stop-timeout-negative", ["--stop-timeout=-5", "SCRIPT"], {}, ["--stop-timeout=-5", ">= 0"]),
    ("exit-barrier-negative", ["--exit-barrier-timeout=-1", "SCRIPT"], {}, ["--exit-barrier-timeout=-1"]),
    ("hang-timeout-negative", ["--hang-timeout=-1", "SCRIPT"], {}, ["--hang-timeout=-1"]),
    ("startup-timeout-junk", ["--startup-timeout=soon", "SCRIPT"], {}, ["--startup-timeout=soon", "seconds"]),
    ("rdzv-conf-malformed", ["--rdzv-conf=join_timeout", "SCRIPT"], {}, ["KEY=VALUE"]),
    ("rdzv-conf-negative-timeout", ["--rdzv-conf=join_timeout=-3", "SCRIPT"], {}, ["join_timeout=-3"]),
    ("unknown-flag", ["--nprocs=2", "SCRIPT"], {}, ["unknown option --nprocs", "--nproc-per-node"]),
    ("bad-bool-env", ["SCRIPT"], {"PET_STANDALONE": "maybe"}, ["PET_STANDALONE", "1/true/yes"]),
    ("standalone-many-nodes", ["--standalone", "--nnodes=2", "SCRIPT"], {}, ["--standalone runs one node"]),
    ("start-method", ["--start-method=thread", "SCRIPT"], {}, ["--start-method=thread", "spawn, fork"]),
    ("ranks-filter", ["--local-ranks-filter=a", "SCRIPT"], {}, ["--local-ranks-filter=a"]),
    ("quiet-and-verbose", ["-q", "-v", "SCRIPT"], {}, ["exclude each other"]),
    ("flag-without-value", ["--rdzv-id"], {}, ["--rdzv-id needs a value"]),
]
# fmt: on


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    # Running it at all would leave this file behind.
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return tmp_path


def _processes_with_marker(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER_ENV) == marker:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def _run(argv: list[str], extra_env: dict[str, str], marker: str) -> tuple[int, str, str, int]:
    """Run the command in a session of its own; returns (exit status, stdout, stderr, its pid).

    Output goes to files, not pipes, so that the wait ends when the command exits even if it
    left a process behind holding its output open (that process is then found and reported).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env.update(extra_env, PYTHONPATH=str(ROOT), **{MARKER_ENV: marker})
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastrun", *argv], cwd=ROOT, env=env,
            stdout=out, stderr=err, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), proc.pid


def _kill_leftovers(pid: int, marker: str) -> None:
    """Clean up after a failed check, by pid only."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for leftover in _processes_with_marker(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(leftover, signal.SIGKILL)


@pytest.mark.parametrize(("argv", "env", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_starts_nothing(
    workdir: Path, argv: list[str], env: dict[str, str], words: list[str]
) -> None:
    log_dir = workdir / "logs"
    places = {"SCRIPT": str(workdir / "train.py"), "MISSING": str(workdir / "missing.py")}
    argv = [places.get(arg, arg) for arg in argv]
    if places["SCRIPT"] in argv or places["MISSING"] in argv:
        argv.append("--script-arg")
    marker = uuid.uuid4().hex
    code, out, err, pid = _run([f"--log-dir={log_dir}", *argv], env, marker)

    lines = err.splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("elastrun: error: "), lines[0]
    assert "Traceback" not in err and out == ""
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not (workdir / "ran").exists(), "the training script ran"
    assert not log_dir.exists(), "a log directory was created"
    # Nothing of the run is left: neither in its process group nor anywhere with its environment.
    try:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
        assert _processes_with_marker(marker) == []
    finally:
        _kill_leftovers(pid, marker)


def test_unknown_backend_lists_every_known_backend(workdir: Path) -> None:
    code, _, err, _ = _run(["--rdzv-backend=nosuch", str(workdir / "train.py")], {}, uuid.uuid4().hex)
    assert code == 2 and len(err.splitlines()) == 1
    for name in known_backends():
        assert name in err, name


def test_help_exits_0_and_documents_defaults() -> None:
    code, out, err, _ = _run(["--help"], {}, uuid.uuid4().hex)
    assert code == 0 and err == ""
    assert out.startswith("usage: elastrun")
    for text in ("--nproc-per-node", "--nnodes N|MIN:MAX", "Default: 1:1.", "PET_NNODES", "--standalone"):
        assert text in out, text
