"""Keeping the evidence of a failed end-to-end run: stacks first, then the work directory.

A run that fails, stalls or times out is only worth its evidence: the agents' event logs and
console output, the workers' logs and step records, and where every process was when it went
wrong.  The harnesses (the soak, the chaos run, the end-to-end test fixtures) do, in this order:

1. :func:`dump_stacks` while every process still runs: each one that catches
   :data:`elastrun.shared.stackdump.DUMP_SIGNAL` (every agent and every Python worker of elastrun) writes
   every thread's Python stack to its own log, and lives on; the list of the processes, their
   state and command line goes to ``processes.txt``;
2. their usual clean-up (every process killed by PID);
3. :func:`keep`: the work directory moves (or, when the harness does not own it, is copied) under
   ``$ELASTRUN_EVIDENCE_DIR`` (default ``<tmp>/elastrun-evidence``), with ``WHY.txt`` saying what
   went wrong, and the path is printed.

Example::

    with ChaosJob(spec) as job:
        ...
        job.snapshot("no committed step for 30 s")     # stacks, before anything is killed
    # the job's clean-up then keeps the work directory and prints where it is
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from elastrun.shared import stackdump

EVIDENCE_ENV = "ELASTRUN_EVIDENCE_DIR"
#: How long :func:`dump_stacks` waits for the asked processes to take the signal (a stopped one never does).
DELIVERY_WAIT = 3.0


def evidence_root() -> Path:
    return Path(os.environ.get(EVIDENCE_ENV) or Path(tempfile.gettempdir()) / "elastrun-evidence")


def _pending(pid: int) -> bool:
    """Whether the dump signal is still pending for ``pid`` (not yet taken by one of its threads)."""
    bit = 1 << (int(stackdump.DUMP_SIGNAL) - 1)
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("ShdPnd:"):
                    return bool(int(line.split()[1], 16) & bit)
    except (OSError, ValueError, IndexError):
        return False
    return False


def dump_stacks(pids: Iterable[int], out: Path | None = None) -> list[int]:
    """Ask every live process of ``pids`` that catches it for its Python stacks, wait (bounded) until
    each has taken the signal, and list the processes in ``out/processes.txt``; the PIDs asked."""
    pids = sorted(set(pids))
    asked = [pid for pid in pids if stackdump.request(pid)]
    deadline = time.monotonic() + DELIVERY_WAIT
    while time.monotonic() < deadline and any(_pending(pid) for pid in asked):
        time.sleep(0.05)
    time.sleep(0.2)  # the handler writes within microseconds of taking the signal; the log pumps copy it on
    if out is not None:
        lines = [f"# {time.strftime('%Y-%m-%d %H:%M:%S')}: pid, state, stacks asked, command line"]
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                command = " ".join(proc.cmdline()).replace("\n", " ")
                lines.append(f"{pid} {proc.status()} {'stacks' if pid in asked else '-'} {command}")
            except psutil.Error:
                lines.append(f"{pid} gone")
        with open(out / "processes.txt", "a", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
    return asked


def test_failure(item: Any) -> str | None:
    """Why the pytest test ``item`` failed (its set-up or its call), or None; the reports are stored
    on the item by ``tests/conftest.py`` (``pytest_runtest_makereport``)."""
    for when in ("setup", "call"):
        report = getattr(item, f"report_{when}", None)
        if report is not None and report.failed:
            text = str(report.longrepr).strip().splitlines()
            return f"{item.nodeid} failed in its {when}: {text[-1][:300] if text else ''}"
    return None


def keep(work: Path, why: str, name: str, move: bool = True) -> Path:
    """Move (``move``) or copy ``work`` under the evidence root with ``WHY.txt``; print and return where."""
    root = evidence_root()
    root.mkdir(parents=True, exist_ok=True)
    dest = root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        if move:
            shutil.move(str(work), dest)
        else:
            shutil.copytree(work, dest, symlinks=True, ignore_dangling_symlinks=True)
    except OSError as exc:  # what could not be moved stays where it was: say both
        print(f"evidence: could not keep {work} in {dest} ({exc}); look in {work}", file=sys.stderr, flush=True)
        return work
    (dest / "WHY.txt").write_text(why.rstrip() + "\n")
    print(f"evidence kept: {dest} ({why.splitlines()[0][:200]})", file=sys.stderr, flush=True)
    return dest
