"""Helpers for the behavioural tests: run trainer.py under the real elastrun launcher and read
back what it recorded.  Every process is started in its own session and killed by process group
id at the end; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests import warm
from tests.harness import remove_runtime_dirs, wait_until

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("trainer.py")
PRELOAD = "--preload=torch,elastrun.train"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.pop("ELASTRUN_SNAPSHOT_DIR", None)
    return e


def standalone(out: Path, trainer_args: list[str], nproc: int = 2, flags: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "elastrun", "--standalone", f"--nproc-per-node={nproc}", PRELOAD, *flags,
        str(TRAINER), "--out", str(out), *trainer_args,
    ]  # fmt: skip


def elastic(out: Path, port: int, run_id: str, trainer_args: list[str], nnodes: str = "1:2",
            flags: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "elastrun", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}", f"--nnodes={nnodes}", "--nproc-per-node=1", "--max-restarts=3", PRELOAD, *flags,
        str(TRAINER), "--out", str(out), *trainer_args,
    ]  # fmt: skip


class Procs:
    """Launched agents; :meth:`cleanup` SIGKILLs whatever is left (by process group id) and removes the
    node-memory and temporary directories of the agents it started (a SIGKILLed agent cannot)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(log, "wb") as f:
            e = {**env(), **(extra_env or {})}
            p = warm.popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=e, start_new_session=True)
        self.procs.append(p)
        return p

    def run(self, cmd: list[str], log: Path, timeout: float = 120) -> int:
        p = self.start(cmd, log)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(p)
            raise AssertionError(f"launcher did not finish in {timeout} s; log:\n{log.read_text()[-3000:]}") from None

    def pids(self) -> set[int]:
        """Every live launched process and its descendants."""
        import psutil

        pids: set[int] = set()
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                pids |= {p.pid, *(c.pid for c in root.children(recursive=True))}
            except psutil.Error:
                continue
        return pids

    def cleanup(self) -> None:
        for p in self.procs:
            kill_group(p)
        remove_runtime_dirs({p.pid for p in self.procs})


def kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


def wait_for(predicate, timeout: float, what: str) -> None:
    wait_until(predicate, timeout, what=what)


def restores(out: Path) -> dict[tuple[int, int], dict]:
    """``{(attempt, rank): what restore() returned}``."""
    found = {}
    for p in out.glob("restore.r*.a*.json"):
        rank, attempt = p.name[len("restore.r") : -len(".json")].split(".a")
        found[(int(attempt), int(rank))] = json.loads(p.read_text())
    return found


def final(out: Path) -> dict:
    """What the trainer's rank 0 wrote at the end: the last step and the SHA-256 of the parameters."""
    return json.loads((out / "final.json").read_text())


def digests(out: Path) -> dict[int, set[str]]:
    """step -> the SHA-256s of the full parameters committed at that step (by any attempt; ``--fsdp`` runs)."""
    found: dict[int, set[str]] = {}
    for line in (out / "digest.jsonl").read_text().splitlines():
        r = json.loads(line)
        found.setdefault(r["step"], set()).add(r["sha256"])
    return found


def complete_lines(text: str) -> list[str]:
    """The lines of a file another process appends to, without a last one still being written: a reader can
    see part of a write that crosses a page boundary (the file's size grows page by page)."""
    lines = text.split("\n")
    return [line for line in lines[:-1] if line]


def committed_steps(out: Path) -> dict[int, list[dict]]:
    """Per step, the records of the latest attempt that ran it (the one whose commit counted)."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for p in out.glob("batches.r*.jsonl"):
        for line in complete_lines(p.read_text()):
            by_step[json.loads(line)["step"]].append(json.loads(line))
    return {s: [r for r in recs if r["attempt"] == max(x["attempt"] for x in recs)] for s, recs in by_step.items()}


def samples_per_epoch(out: Path) -> dict[int, list[int]]:
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for recs in committed_steps(out).values():
        for r in recs:
            per_epoch[r["epoch"]].extend(r["idx"])
    return per_epoch


def assert_exactly_once(out: Path, samples: int, epochs: int) -> None:
    per_epoch = samples_per_epoch(out)
    assert sorted(per_epoch) == list(range(epochs)), f"epochs seen: {sorted(per_epoch)}"
    for epoch, idx in per_epoch.items():
        assert sorted(idx) == list(range(samples)), (
            f"epoch {epoch}: {len(idx)} samples used, {len(set(idx))} distinct, expected each of {samples} once"
        )
