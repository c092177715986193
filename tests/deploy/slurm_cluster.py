"""A real one-node SLURM cluster for a test: Debian's ``slurmctld`` and ``slurmd`` on this machine.

Everything lives in one temporary directory: ``slurm.conf`` (found through ``SLURM_CONF``, so
``/etc/slurm`` is neither read nor changed), the controller's state, the node's spool, logs and
PID files.  The daemons run in the foreground (``-D``) as children of the test, on free loopback
ports, with ``auth/none`` (no munge daemon to start).  ``cred_expire=5`` shortens the time a
requeued job is held before it may start again (``cred_expire`` + 1 s; 121 s by default) so that a
requeue takes seconds, and ``sched_interval=1`` has the scheduler look at it once a second once
it is eligible (every 60 s by default).  ``close()`` cancels the jobs, stops both
daemons by PID, then kills by PID whatever is left that carries this cluster's ``SLURM_CONF`` in
its environment (step daemons, agents, workers of a job), and removes the directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

from tests.harness import free_port

DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "srun", "sinfo")


def missing_reason() -> str | None:
    """Why a real SLURM cannot run here, or None if it can be tried."""
    if os.geteuid() != 0:
        return "needs root to run slurmctld and slurmd"
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing; tools/setup.sh installs slurm-wlm as root)"
    return None


def _conf(root: Path, node: str, cpus: int) -> str:
    ctld_port, slurmd_port = free_port(), free_port()
    return f"""\
ClusterName=elastruntest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
AuthInfo=cred_expire=5
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
SchedulerParameters=sched_interval=1
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    """``slurmctld`` + ``slurmd`` in ``root``; :meth:`env` is what SLURM commands need to reach them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("state", "spool", "log"):
            (root / sub).mkdir(parents=True)
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.conf.write_text(_conf(root, self.node, os.cpu_count() or 1))
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.jobs: list[str] = []

    def env(self, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def run(self, *argv: str, env: dict[str, str] | None = None, timeout: float = 30) -> str:
        """A SLURM command's stdout; a failure raises with its stderr."""
        res = subprocess.run(argv, env=env or self.env(), capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout

    def start(self, timeout: float = 30) -> str | None:
        """Start both daemons and wait for the node to be idle; the reason if it did not come up."""
        for name in ("slurmctld", "slurmd"):
            with open(self.root / "log" / f"{name}.out", "wb") as out:
                argv = [name, "-D", "-i"] if name == "slurmctld" else [name, "-D"]
                self.daemons.append(subprocess.Popen(argv, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(d.poll() is not None for d in self.daemons):
                break
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                if self.run("sinfo", "-h", "-o", "%T", timeout=5).strip() == "idle":
                    return None
            time.sleep(0.2)
        return f"SLURM did not start within {timeout:g} s: {self.logs()[-1500:]}"

    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> str:
        """Submit; the job id."""
        res = subprocess.run(["sbatch", "--parsable", *args], env=env, cwd=cwd, capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
        job = res.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Reason, Restarts, ExitCode, ...)."""
        fields = {}
        for word in self.run("scontrol", "-o", "show", "job", job, timeout=10).split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.root / "log").glob("*")))

    def leftovers(self) -> list[psutil.Process]:
        """Processes that carry this cluster's SLURM_CONF: daemons' children, step daemons, the jobs."""
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.pid != os.getpid() and proc.environ().get("SLURM_CONF") == str(self.conf):
                    found.append(proc)
        return found

    def close(self) -> None:
        for job in self.jobs:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.run("scancel", job, timeout=10)
        deadline = time.monotonic() + 15
        while self.jobs and time.monotonic() < deadline and any(d.poll() is None for d in self.daemons):
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                if not self.run("squeue", "-h", "-t", "R,CG", timeout=5).strip():
                    break
            time.sleep(0.2)
        for daemon in reversed(self.daemons):  # slurmd first, then the controller
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(5)
        for proc in self.leftovers():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        shutil.rmtree(self.root, ignore_errors=True)
