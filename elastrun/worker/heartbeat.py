"""Worker progress heartbeats: how the agent tells a slow worker from a hung one.

A worker calls :func:`heartbeat` once per unit of progress (``elastrun.train``'s ``commit()``
does it for you).  The call writes the current time into a small file the agent named in
``ELASTRUN_HEARTBEAT_FILE`` (on /dev/shm where possible): one ``pwrite`` at most every 50 ms, so
it costs nothing measurable in a training loop.  The agent reads the file's modification time;
a worker whose heartbeats stop for longer than its hang timeout is dumped (faulthandler, via
SIGABRT) and killed.  A script that never calls ``heartbeat`` is never judged hung.

The same channel carries one more fact: that the worker's script has returned, and with which
exit code (:func:`report_exit`, called by :mod:`elastrun.worker.bootstrap`).  What the process
does after that — interpreter teardown — cannot fail the job: the agent reads the code back
(:func:`elastrun.agent.workers.reports.read_exit_report`) and keeps it whatever signal or hang ends the
process.

Example::

    import elastrun

    for batch in loader:
        train_step(batch)
        elastrun.heartbeat()
"""

from __future__ import annotations

import os
import time

from elastrun.shared.protocol import HEARTBEAT_ENV, exit_report_path

_MIN_INTERVAL = 0.05
_fd: int | None = None
_last = 0.0
_count = 0


def heartbeat() -> None:
    """Tell the agent this worker made progress.  A no-op outside elastrun."""
    global _fd, _last, _count
    now = time.monotonic()
    if now - _last < _MIN_INTERVAL:
        return
    _last = now
    if _fd is None:
        path = os.environ.get(HEARTBEAT_ENV)
        if not path:
            _fd = -1
            return
        try:
            _fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError:
            _fd = -1
            return
    if _fd < 0:
        return
    _count += 1
    try:
        os.pwrite(_fd, f"{_count:>12d} {time.time():.3f}\n".encode(), 0)
    except OSError:
        pass


def report_exit(code: int) -> None:
    """Tell the agent the script returned with ``code`` (a no-op outside elastrun).

    Written to a temporary name and renamed, so the agent never reads half a report.
    """
    path = os.environ.get(HEARTBEAT_ENV)
    if not path:
        return
    final = exit_report_path(path)
    tmp = f"{final}.tmp"
    try:
        with open(tmp, "w", encoding="ascii") as fh:
            fh.write(f"{int(code)}\n")
        os.replace(tmp, final)
    except OSError:
        pass


def reset() -> None:
    """Forget the open heartbeat file: the next :func:`heartbeat` opens ``ELASTRUN_HEARTBEAT_FILE`` again.

    Used by a worker that stays in its process across a re-form and gets a new file.
    """
    global _fd, _last
    if _fd is not None and _fd >= 0:
        try:
            os.close(_fd)
        except OSError:
            pass
    _fd = None
    _last = 0.0
