"""What a worker leaves for its agent, read on the agent's side: heartbeats, exit reports, error files.

The worker writes them (:mod:`elastrun.worker.heartbeat`, :mod:`elastrun.worker.errorfile`);
the agent only reads them, and clears a rank's heartbeat and exit report before starting a worker
with those paths.  Their names and places are in :mod:`elastrun.shared.protocol`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from elastrun.shared.protocol import exit_report_path


def read_heartbeat(path: str) -> float | None:
    """Modification time (``time.time()`` clock) of a heartbeat file, or None if none was written."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime if st.st_size else None


def read_exit_report(heartbeat_path: str) -> tuple[int, float] | None:
    """The exit code a worker's script returned with and when it was reported, or None if not yet."""
    final = exit_report_path(heartbeat_path)
    try:
        with open(final, encoding="ascii") as fh:
            code = int(fh.read().strip())
        return code, os.stat(final).st_mtime
    except (OSError, ValueError):
        return None


def clear_reports(heartbeat_path: str) -> None:
    """Remove an earlier worker's heartbeat and exit report before a worker with these paths starts."""
    for path in (heartbeat_path, exit_report_path(heartbeat_path)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def read_error_file(path: Path | str | None) -> tuple[str, float | None] | None:
    """The (text, timestamp) of an error file, or None when absent or unreadable.

    The text is the Python traceback when the file has one, else its message.
    """
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    message = data.get("message", data)
    if isinstance(message, str):
        return message, None
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    text = extra.get("py_callstack") or message.get("message") or json.dumps(message)
    stamp = extra.get("timestamp")
    try:
        timestamp = float(stamp) if stamp is not None else None
    except ValueError:
        timestamp = None
    return str(text), timestamp
