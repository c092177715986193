"""Where a worker keeps its memory snapshots, and who owns that directory.

Under the elastrun agent the answer is given (``ELASTRUN_SNAPSHOT_DIR``): the agent owns the
directory, keeps it across its workers' restarts and removes it when it exits.

Under another launcher (torchrun sets ``TORCHELASTIC_RUN_ID``) nobody removes it, and the run id
alone does not name one job: a second job started with the same ``--rdzv-id`` would find the first
job's snapshots and resume from them, and two launchers of one job on one host would share one
directory.  So the directory is tied to the *launcher process*, the worker's parent, which stays
the same across the worker restarts it makes (the reason for keeping snapshots in memory):

- its name carries the launcher's PID, and ``owner.pid`` / ``owner.start`` inside it record that
  PID and its start time (a PID reused by a later process is not taken for the same launcher);
- whoever finds a directory of a launcher that no longer runs removes it, so a killed job's
  snapshots leave node memory when the next job on the host starts.

A worker started by a wrapper (``torchrun --no-python bash wrap.sh``) has the wrapper as its parent
and so gets a new directory on every restart: it restores from disk or peers, never from another
job's memory.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import psutil

from elastrun.shared.protocol import SNAPSHOT_DIR_ENV

PREFIX = "elastrun-snap-"


def snapshot_dir(explicit: str | Path | None) -> tuple[Path, bool]:
    """The node-local snapshot directory and whether this process owns (must remove) it at close."""
    if explicit is not None:
        return Path(explicit), False
    if os.environ.get(SNAPSHOT_DIR_ENV):
        return Path(os.environ[SNAPSHOT_DIR_ENV]), False
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return launcher_dir(base, run_id, os.getppid()), False
    return Path(tempfile.mkdtemp(prefix=PREFIX, dir=base)), True


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` as text, None when it does not run (or cannot be read)."""
    try:
        return repr(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def _owner(path: Path) -> tuple[int, str] | None:
    try:
        return int((path / "owner.pid").read_text()), (path / "owner.start").read_text()
    except (OSError, ValueError):
        return None


def _write(path: Path, name: str, text: str) -> None:
    tmp = path / f".{name}.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, path / name)


def launcher_dir(base: Path, run_id: str, launcher_pid: int) -> Path:
    """This launcher's directory under ``base`` for job ``run_id``: swept of dead launchers' ones, made if new.

    Every local rank calls this at once; each step is safe to run concurrently (the owner files
    are written whole, and a directory is removed only when its recorded launcher is gone).
    """
    sweep(base)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    path = base / f"{PREFIX}{safe}-{socket.gethostname()}-{os.getuid()}-p{launcher_pid}"
    start = _start_time(launcher_pid) or "unknown"
    owner = _owner(path)
    if owner is not None and owner != (launcher_pid, start):  # an earlier launcher that had this PID
        shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    _write(path, "owner.pid", str(launcher_pid))
    _write(path, "owner.start", start)
    return path


def sweep(base: Path) -> None:
    """Remove this user's launcher directories under ``base`` whose launcher no longer runs."""
    for path in base.glob(f"{PREFIX}*-{os.getuid()}-p*"):
        owner = _owner(path)
        if owner is None:
            continue  # being made right now, or not one of ours
        pid, start = owner
        alive = psutil.pid_exists(pid) if start == "unknown" else _start_time(pid) == start
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
