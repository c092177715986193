"""Reading back what the chaos trainer and the agents wrote: step records, restores, events.

:class:`StepLog` tails the trainer's ``steps.<pid>.jsonl`` files incrementally (a long chaos run
writes tens of thousands of lines and the harness polls them many times a second).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from elastrun.observe.events import read_log_dir


class StepLog:
    """Every step record of every worker under ``out``, read incrementally."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.records: list[dict[str, Any]] = []
        self._offsets: dict[Path, int] = {}
        #: When the newest step record was written (Unix time; 0 before the first).
        self.newest = 0.0

    def refresh(self) -> list[dict[str, Any]]:
        """Read what was appended since the last call; returns the new records."""
        new: list[dict[str, Any]] = []
        for path in sorted(self.out.glob("steps.*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            for line in data[:end].splitlines():
                if line.strip():
                    new.append(json.loads(line))
            self._offsets[path] = offset + end
        new.sort(key=lambda r: r["t"])
        self.records.extend(new)
        if new:
            self.newest = max(self.newest, new[-1]["t"])
        return new

    def max_generation(self) -> int:
        return max((r["g"] for r in self.records), default=-1)

    def after(self, t: float) -> list[dict[str, Any]]:
        """Records written after time ``t`` (the list is only roughly time-ordered across reads)."""
        return [r for r in self.records if r["t"] > t]


def committed(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Per step, the records of the latest generation that ran it: the ones whose commit counted."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[r["s"]].append(r)
    result = {}
    for step, recs in by_step.items():
        latest = max(r["g"] for r in recs)
        result[step] = sorted((r for r in recs if r["g"] == latest), key=lambda r: r["r"])
    return dict(sorted(result.items()))


def restores(out: Path) -> list[dict[str, Any]]:
    """What every worker's ``restore()`` returned, oldest first."""
    found = [json.loads(p.read_text()) for p in out.glob("restore.*.json")]
    return sorted(found, key=lambda r: r["t"])


def events(log_dir: Path) -> list[dict[str, Any]]:
    """All agents' events, oldest first."""
    return read_log_dir(log_dir)
