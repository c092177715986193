"""Structured events of an agent: one JSON object per line, so a job's history can be read back.

Runs in: the agent (writes); the CLI reads the files back (``elastrun timeline`` / ``goodput``).

Every agent writes ``events-<node>.jsonl`` under ``--log-dir`` (and, with ``--event-log-stdout``,
to stdout).  Each line has ``ts`` (Unix time), ``node`` (node id), ``event`` (one of
:data:`EVENT_KINDS`) and event-specific fields.  ``elastrun timeline`` and the tests read them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from elastrun.shared import log

#: Something called with every event record (a dict), e.g. the metrics registry's feeder.
Listener = Callable[[dict[str, Any]], None]

#: The kinds of events an agent emits, and their main fields.
EVENT_KINDS: dict[str, str] = {
    "agent_start": "run_id, backend, min_nodes, max_nodes, nproc, pid, hostname",
    "round_start": "after (the last round this node was in, or null)",
    "join_deferred": "(none: a first join into a job that trains waits for this node's start-up)",
    "join_resumed": "waited (s), ended_by (ready, round forming, limit or rendezvous error)",
    "round_closed": (
        "round, generation, group_rank, group_world_size, world_size, members, duration, restarts_used, "
        "max_restarts"
    ),
    "worker_start": "round, generation, rank, local_rank, pid, start_method",
    "worker_stepping": (
        "round, generation, rank, local_rank, pid, first_heartbeat (its Unix time), since_start (s from the "
        "worker's start)"
    ),
    "worker_exit": "round, generation, rank, local_rank, pid, exitcode, signal, alive_at (last seen running)",
    "worker_failure": "round, generation, rank, local_rank, exitcode, signal, message",
    "teardown_fault": "round, rank, local_rank, exitcode (the script's, kept), fault, after (s since it returned)",
    "restart": "round, reason, restarts_used, max_restarts",
    "node_lost": "round (the first round without them), lost (node ids), causes (node id: link, silence or left)",
    "nodes_waiting": "round, count",
    "scale_change": "old_world_size, new_world_size",
    "hang_detected": "round, rank, local_rank, reason",
    "stall": (
        "round, generation, reason, workers (each local worker: rank, pid, entered, since_start, beats, "
        "last_beat_ago, reformed, record, doing, silent), stacks (ranks asked for their stacks)"
    ),
    "recovered": "round, reason, duration (s from the fault to all workers started)",
    "reform": (
        "round, duration (s from the change to every kept worker re-formed), paused_in, kept, restarted (local "
        "ranks), sources, step, at_commit (the kept workers left at the end of a commit, for a join or a "
        "pre-empted rank: nothing of a step thrown away)"
    ),
    "reform_fallback": "rank, local_rank, pid, cause (why a worker that opted in is restarted instead of kept)",
    "signal": "signal, action, grace",
    "job_failed": "reason, exitcode",
    "rendezvous_warning": "message, kind (e.g. forged_value), key, why",
    "agent_exit": "exitcode, reason",
}


class EventLog:
    """Appends events to a JSON-lines file and/or a stream; thread-safe and cheap when disabled."""

    def __init__(self, node_id: str, path: Path | None = None, stream: TextIO | None = None) -> None:
        self.node_id = node_id
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open
        self._stream = stream
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event_dict)`` for every event (e.g. the metrics registry)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``; a listener that is not registered is ignored."""
        try:
            self._listeners.remove(listener)
        except ValueError:
            pass

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event (``ts`` and ``node`` added) and hand it to the listeners; returns the record."""
        record = {"ts": round(time.time(), 6), "node": self.node_id, "event": event, **fields}
        line = json.dumps(record, separators=(",", ":"), default=str)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
            if self._stream is not None:
                try:
                    self._stream.write(line + "\n")
                    self._stream.flush()
                except (OSError, ValueError):  # the reader went away (`elastrun ... | head`): the job goes on
                    self._stream = None
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception as exc:  # a broken listener must not stop the agent
                log.get("observe").error(f"event listener failed: {exc}")
        return record

    def close(self) -> None:
        """Flush the file to disk and close it; later events still reach the stream and listeners."""
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None


def event_files(log_dir: str | Path) -> list[Path]:
    """Every ``events-*.jsonl`` under ``log_dir`` (searched recursively, so one directory per node works)."""
    return sorted(p for p in Path(log_dir).rglob("events-*.jsonl") if p.is_file())


def read_log_dir(log_dir: str | Path) -> list[dict[str, Any]]:
    """All events of all nodes under ``log_dir``, oldest first (ties keep each file's order)."""
    events: list[dict[str, Any]] = []
    for path in event_files(log_dir):
        events.extend(read_events(path))
    events.sort(key=lambda e: float(e.get("ts", 0.0)))
    return events


def read_events(path: Path) -> list[dict[str, Any]]:
    """Read one events file, skipping a torn last line (an agent killed mid-write)."""
    events = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
