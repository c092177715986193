"""deploy/slurm/elastrun.sbatch: its syntax, the elastrun command it starts, and its signal handling.

The script runs for real under bash, with stand-ins for SLURM's own programs (``srun``, ``scontrol``,
``scancel``) first on PATH: they record how they were called. The elastrun command line ``srun`` was
given then goes through elastrun's own argument parser. The time-limit test sends USR1 to the running
batch shell, as SLURM's ``--signal=B:USR1@N`` would, and checks that the job step was sent SIGTERM
through ``scancel`` and the job was requeued. The same script under a real SLURM:
``test_slurm_cluster.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun import cli
from tests.deploy.podenv import REPO

pytestmark = pytest.mark.e2e

SBATCH = REPO / "deploy" / "slurm" / "elastrun.sbatch"
EXAMPLE = REPO / "examples" / "train_imagenet_style.py"

FAKE_SRUN = r"""#!/bin/bash
# Stand-in for srun: records its argv, reports SIGTERM, runs for FAKE_SRUN_SECONDS, exits FAKE_SRUN_EXIT.
trap 'echo TERM >> "$FAKE_SLURM_LOG/srun.signals"; kill "$sleeper" 2>/dev/null; exit 143' TERM
echo $$ > "$FAKE_SLURM_LOG/srun.pid"
printf '%s\0' "$@" > "$FAKE_SLURM_LOG/srun.argv.tmp"
mv "$FAKE_SLURM_LOG/srun.argv.tmp" "$FAKE_SLURM_LOG/srun.argv"
sleep "${FAKE_SRUN_SECONDS:-0}" &
sleeper=$!
wait "$sleeper"
exit "${FAKE_SRUN_EXIT:-0}"
"""

FAKE_SCONTROL = r"""#!/bin/bash
# Stand-in for scontrol: `show hostnames LIST` prints FAKE_NODES, anything else is recorded.
if [[ $1 == show && $2 == hostnames ]]; then
    printf '%s\n' $FAKE_NODES
else
    echo "$*" >> "$FAKE_SLURM_LOG/scontrol.calls"
fi
"""

FAKE_SCANCEL = r"""#!/bin/bash
# Stand-in for scancel: records its arguments; --signal=TERM reaches the job step (the fake srun).
echo "$*" >> "$FAKE_SLURM_LOG/scancel.calls"
if [[ $1 == --signal=TERM ]]; then kill -TERM "$(cat "$FAKE_SLURM_LOG/srun.pid")"; fi
"""


class FakeSlurm:
    """A temp directory with the stand-ins, and the batch shells started against them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.log = root / "log"
        self.submit_dir = root / "submit"
        for d in (self.root, self.bin, self.log, self.submit_dir):
            d.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.procs: list[subprocess.Popen[str]] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "HOME": str(self.root),
            "FAKE_SLURM_LOG": str(self.log),
            "FAKE_NODES": "node01 node02 node03 node04",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "elastic-imagenet",
            "SLURM_JOB_NODELIST": "node[01-04]",
            "SLURM_JOB_NUM_NODES": "4",
            "SLURM_SUBMIT_DIR": str(self.submit_dir),
        }
        env.update(extra)
        return env

    def start(self, env: dict[str, str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            ["bash", str(SBATCH)],
            env=env,
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def run(self, env: dict[str, str], timeout: float = 20) -> subprocess.CompletedProcess[str]:
        proc = self.start(env)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def srun_argv(self) -> list[str]:
        return (self.log / "srun.argv").read_text().split("\0")[:-1]

    def wait_for_srun(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not (self.log / "srun.argv").exists():
            assert time.monotonic() < deadline, "the batch script never started srun"
            time.sleep(0.05)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the shell, fake srun, sleep
            proc.communicate()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[FakeSlurm]:
    fake = FakeSlurm(tmp_path / "slurm")
    yield fake
    fake.close()


def _directives() -> dict[str, str]:
    """The script's ``#SBATCH --name[=value]`` lines, as a dict."""
    found = {}
    for line in SBATCH.read_text().splitlines():
        m = re.match(r"#SBATCH\s+(--[\w-]+)(?:=(\S+))?", line)
        if m:
            found[m.group(1)] = m.group(2) or ""
    return found


def _elastrun_argv(srun_argv: list[str]) -> tuple[list[str], list[str]]:
    """Split srun's argv into srun's own options and the elastrun command line after ``elastrun``."""
    assert "elastrun" in srun_argv, srun_argv
    at = srun_argv.index("elastrun")
    assert all(word.startswith("-") for word in srun_argv[:at]), "srun must run elastrun itself"
    return srun_argv[:at], srun_argv[at + 1 :]


def test_sbatch_script_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


@pytest.mark.unit
def test_sbatch_directives_suit_an_elastic_job() -> None:
    d = _directives()
    assert d["--ntasks-per-node"] == "1", "one agent per node"
    assert "--no-kill" in d, "a failed node must not end the allocation"
    assert "--requeue" in d
    m = re.fullmatch(r"B:USR1@(\d+)", d["--signal"])
    assert m, "the time-limit warning goes to the batch shell, which forwards SIGTERM"
    stop_timeout = float(re.search(r"ELASTRUN_STOP_TIMEOUT:-(\d+)", SBATCH.read_text()).group(1))
    assert int(m.group(1)) >= stop_timeout + 30, "the warning must leave time to checkpoint and exit"


def test_outside_slurm_the_script_says_so(slurm: FakeSlurm) -> None:
    env = slurm.env()
    del env["SLURM_JOB_ID"]
    result = slurm.run(env)
    assert result.returncode != 0
    assert "run this script with sbatch" in result.stderr
    assert not (slurm.log / "srun.argv").exists()


def test_etcd_backend_without_endpoints_is_a_clear_error(slurm: FakeSlurm) -> None:
    result = slurm.run(slurm.env(ELASTRUN_RDZV_BACKEND="etcd"))
    assert result.returncode != 0
    assert "ELASTRUN_ETCD_ENDPOINTS" in result.stderr
    assert not (slurm.log / "srun.argv").exists()


def test_srun_starts_one_agent_per_node_that_survives_the_others(slurm: FakeSlurm) -> None:
    result = slurm.run(slurm.env())
    assert result.returncode == 0, result.stderr
    srun_opts, _ = _elastrun_argv(slurm.srun_argv())
    assert "--ntasks-per-node=1" in srun_opts
    assert "--kill-on-bad-exit=0" in srun_opts
    assert "--nodes=4" in srun_opts


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch):
    assert EXAMPLE.exists(), EXAMPLE
    monkeypatch.chdir(REPO)  # sbatch runs the script from the submit directory, the repository root
    return cli.parse


def test_c10d_command_line_parses_to_the_intended_launch(slurm: FakeSlurm, parse) -> None:
    result = slurm.run(slurm.env())
    assert result.returncode == 0, result.stderr
    _, argv = _elastrun_argv(slurm.srun_argv())
    cfg = parse(argv, {})
    assert cfg.rdzv_backend == "c10d"
    assert cfg.rdzv_endpoint == "node01:29400"
    assert (cfg.min_nodes, cfg.max_nodes) == (1, 4)
    assert cfg.run_id == "slurm-4242-0"
    assert cfg.nproc_per_node == 1
    assert cfg.stop_timeout == 60.0
    assert cfg.entrypoint == "examples/train_imagenet_style.py"
    assert cfg.args == ["--checkpoint-dir", f"{slurm.submit_dir}/checkpoints/elastic-imagenet"]


def test_arguments_after_the_batch_script_go_to_the_training_script(slurm: FakeSlurm, parse) -> None:
    # sbatch passes the words after the script's name to it as "$@".
    result = subprocess.run(["bash", str(SBATCH), "--epochs", "5", "--lr", "0.1"], env=slurm.env(), cwd=REPO,
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 0, result.stderr
    _, argv = _elastrun_argv(slurm.srun_argv())
    cfg = parse(argv, {})
    assert cfg.args[-4:] == ["--epochs", "5", "--lr", "0.1"]


def test_etcd_command_line_parses_to_the_intended_launch(slurm: FakeSlurm, parse) -> None:
    endpoints = "etcd1:2379,etcd2:2379,etcd3:2379"
    env = slurm.env(
        ELASTRUN_RDZV_BACKEND="etcd",
        ELASTRUN_ETCD_ENDPOINTS=endpoints,
        ELASTRUN_MIN_NODES="2",
        ELASTRUN_MAX_NODES="8",
        ELASTRUN_RDZV_ID="shared-run",
        SLURM_GPUS_ON_NODE="4",
        SLURM_RESTART_COUNT="3",
    )
    result = slurm.run(env)
    assert result.returncode == 0, result.stderr
    _, argv = _elastrun_argv(slurm.srun_argv())
    cfg = parse(argv, {})
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint) == ("etcd", endpoints)
    assert (cfg.min_nodes, cfg.max_nodes) == (2, 8)
    assert cfg.run_id == "shared-run"
    assert cfg.nproc_per_node == 4


def test_time_limit_warning_stops_agents_with_sigterm_and_requeues(slurm: FakeSlurm) -> None:
    proc = slurm.start(slurm.env(FAKE_SRUN_SECONDS="20"))
    slurm.wait_for_srun()
    os.kill(proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@120 does
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    # The step's tasks get SIGTERM from SLURM (scancel --signal), not srun: srun would force-kill them.
    assert (slurm.log / "scancel.calls").read_text().splitlines() == ["--signal=TERM 4242"]
    assert (slurm.log / "srun.signals").read_text().split() == ["TERM"]
    assert (slurm.log / "scontrol.calls").read_text().split("\n")[0] == "requeue 4242"


def test_preemption_sigterm_waits_for_the_agents_and_does_not_requeue(slurm: FakeSlurm) -> None:
    # On pre-emption SLURM signals the agents itself; the fake srun ends 2 s later as they would.
    proc = slurm.start(slurm.env(FAKE_SRUN_SECONDS="2", FAKE_SRUN_EXIT="143"))
    slurm.wait_for_srun()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 143, f"the shell must outlive srun and pass on its status: {err}"
    assert not (slurm.log / "srun.signals").exists(), "SLURM already signalled the agents"
    assert not (slurm.log / "scancel.calls").exists()
    assert not (slurm.log / "scontrol.calls").exists(), "a pre-empted job is requeued by SLURM, not by us"
