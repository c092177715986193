"""What each local worker was doing when its group was judged stuck: the report of a hang or a stall.

When the group finds a worker silent past its bound (a hang after heartbeats, or no first
heartbeat within the start-up bound: :mod:`elastrun.agent.hang`), the agent says, for every local
worker, how it entered the round (started, or kept through an in-process re-form and whether it
said ``Reformed``), its last heartbeat and the newest record of its step log (a commit, a restore,
a blocking checkpoint), then asks each for its Python stacks (:mod:`elastrun.shared.stackdump`) before
anything is killed or paused.  Those lines name where a group that forms but never steps stands:
in its process group's set-up or its restore (no restore record in this round), or between its
restore and its first commit.

Everything here is a pure description of facts the group hands over (:class:`WorkerState`), so it
is unit-tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastrun.shared import steplog


@dataclass
class WorkerState:
    """One local worker at the moment its group was judged stuck."""

    rank: int
    local_rank: int
    pid: int
    #: ``"kept"`` (through an in-process re-form) or how it was started (``"fork-pool"``, ``"exec"``).
    entered: str
    #: Seconds since its start or its new assignment (a kept worker).
    since_start: float
    beats: int
    #: Seconds since its last heartbeat in this round (None: none yet).
    last_beat_ago: float | None
    #: A kept worker's re-form: ``(source, step)`` once it said ``Reformed``, None before; unused otherwise.
    reformed: tuple[str | None, int] | None = None
    #: The newest record of its step log, described (None: no step log, or empty).
    record: str | None = None
    #: Why it was judged stuck (None: it was not, it is only listed).
    silent: str | None = None

    def doing(self) -> str:
        """Where this worker most likely is, from the facts above."""
        if self.last_beat_ago is not None:
            return "stepping" if self.silent is None else "silent after its heartbeats (in a step or a collective)"
        if self.entered == "kept" and self.reformed is None:
            return "not re-formed yet: in its new process group's set-up or its restore"
        if self.entered == "kept":
            return "re-formed, before its first heartbeat (its first step)"
        return "before its first heartbeat (its process group's set-up, its restore or its first step)"

    def line(self) -> str:
        """One console line."""
        how = "kept through a re-form, assigned" if self.entered == "kept" else f"started ({self.entered})"
        beat = (f"last heartbeat {self.last_beat_ago:.1f} s ago ({self.beats} in this round)"
                if self.last_beat_ago is not None else "no heartbeat in this round")
        parts = [f"rank {self.rank} (pid {self.pid}): {how} {self.since_start:.1f} s ago", beat]
        if self.entered == "kept" and self.reformed is not None:
            source, step = self.reformed
            parts.append(f"re-formed from {source} at step {step}")
        parts.append(f"last step record: {self.record or 'none'}")
        parts.append(self.doing())
        return "; ".join(parts)

    def as_event(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": self.local_rank, "pid": self.pid, "entered": self.entered,
                "since_start": round(self.since_start, 3), "beats": self.beats,
                "last_beat_ago": None if self.last_beat_ago is None else round(self.last_beat_ago, 3),
                "reformed": None if self.reformed is None else list(self.reformed), "record": self.record,
                "doing": self.doing(), "silent": self.silent}


def describe_record(record: steplog.Record | None, now: float, current_round: int) -> str | None:
    """A step-log record as words: ``committed step 812 in round 14, 30.2 s ago``."""
    if record is None:
        return None
    where = f"round {record.round}" if record.round != current_round else "this round"
    if record.kind == steplog.STEP:
        return f"committed step {record.step} in {where}, {now - record.t2:.1f} s ago"
    if record.kind == steplog.RESTORE:
        source = record.source or "nothing (a fresh start)"
        return (f"restored step {record.step} from {source} in {where}, {now - record.t1:.1f} s ago "
                f"(took {record.t1 - record.t0:.2f} s)")
    if record.kind == steplog.BLOCKED:
        return f"blocked in a checkpoint or flush in {where} until {now - record.t1:.1f} s ago"
    return None


def step_log_path(env: dict[str, str], error_file: Path | None, pid: int) -> Path | None:
    """Where worker ``pid`` writes its step records (as :func:`elastrun.shared.steplog.default_path`)."""
    explicit = env.get(steplog.PATH_ENV)
    if explicit:
        return Path(explicit)
    return error_file.parent / f"steps-{pid}.bin" if error_file is not None else None


def last_record(env: dict[str, str], error_file: Path | None, pid: int, now: float, current_round: int) -> str | None:
    """The newest record of worker ``pid``'s step log, described (None: none)."""
    path = step_log_path(env, error_file, pid)
    return describe_record(steplog.last(path), now, current_round) if path is not None else None
