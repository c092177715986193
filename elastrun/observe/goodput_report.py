"""Goodput in words: the end-of-job summary line, ``elastrun goodput``'s table, its JSON document.

Runs in: the agent (its end-of-job line, the goodput metrics) and the CLI (``elastrun goodput``).

:func:`load` reads a log directory (events and step records) into a
:class:`~elastrun.observe.goodput.Goodput`; :func:`summary_line`, :func:`format_breakdown` and
:func:`to_json` turn one into text.  :class:`GoodputTracker` keeps a running agent's events so
that its summary line and its metrics can be computed at any moment.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from elastrun.observe.goodput import CAUSE_LABELS, CAUSES, Goodput, compute
from elastrun.shared.steplog import ProcessLog, read_dirs

#: Short names of the causes, for one line.
SHORT = {
    "startup": "start-up", "rendezvous": "rendezvous", "detection": "detection", "restart": "restart/re-form",
    "restore": "restore", "redone": "redone steps", "commit": "commit/checkpoint", "hang": "hang",
    "idle": "idle", "unknown": "not measured",
}


def read_logs(dirs: list[Path] | list[str]) -> dict[tuple[str, Any], ProcessLog]:
    """Step logs under ``dirs``, keyed by (node id, pid) as :func:`~elastrun.observe.goodput.compute` wants."""
    return {(p.node, p.pid): p for p in read_dirs(dirs).values()}


def load(log_dir: str | Path, now: float | None = None) -> Goodput:
    """Goodput of the job whose agents wrote ``--log-dir=log_dir`` (``now``: measure a running job so far)."""
    from elastrun.observe.events import event_files, read_log_dir

    if not Path(log_dir).is_dir():
        raise FileNotFoundError(f"{log_dir} is not a directory")
    if not event_files(log_dir):
        raise FileNotFoundError(f"no events-*.jsonl files under {log_dir}; was the job run with --log-dir?")
    return compute(read_log_dir(log_dir), read_logs([log_dir]), now=now)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _fault_name(gp: Goodput, index: int | None) -> str:
    if index is None:
        return ""
    f = gp.faults[index]
    return f"{f.label} at {f.at - gp.start:.0f} s"


def top_causes(gp: Goodput, count: int = 3) -> list[tuple[str, float, int | None, float]]:
    """The largest badput causes: (cause, device-seconds, the fault that caused most of it, its seconds)."""
    ranked = sorted(((c, s) for c, s in gp.badput.items() if s >= 0.05), key=lambda cs: -cs[1])[:count]
    out = []
    for cause, seconds in ranked:
        part, index = max(((f.cost.get(cause, 0.0), f.index) for f in gp.faults), default=(0.0, None))
        out.append((cause, seconds, index if part >= 0.05 else None, part))
    return out


def summary_line(gp: Goodput) -> str:
    """One line: goodput in %, then the top badput causes in seconds, each with the fault behind it.

    ``goodput 53.5 % of 3 worker(s) x 23.8 s (wall 50.6 %); badput 23.7 worker-s, 4 fault(s): rendezvous
    6.6 s, hang 6.2 s (rank 2 hung at 16 s), restart/re-form 5.0 s (of which 2.2 s from 1 node(s) joined
    at 13 s)``: a cause that no fault caused half of names the fault with the largest part of it when
    that part is a fifth or more; the rest is the job's own start and end.  A job measured while it
    runs says ``goodput so far``: that figure is not the final one.
    """
    if gp.basis == "none":
        return (f"goodput not measured: the workers send neither step records (elastrun.train) nor heartbeats "
                f"(elastrun.heartbeat()); {len(gp.faults)} fault(s) in {gp.wall:.1f} s")
    name = "goodput so far" if gp.live else "goodput"
    head = (f"{name} {_pct(gp.ratio)} of {gp.slots} worker(s) x {gp.wall:.1f} s (wall {_pct(gp.wall_ratio)})"
            + (" from heartbeats only: redone steps unknown" if gp.basis == "heartbeats" else ""))
    bad = gp.device_seconds - gp.good
    parts = []
    for cause, seconds, fault, part in top_causes(gp):
        name = _fault_name(gp, fault)
        if name and part < 0.5 * seconds:  # spread over faults, or mostly the job's own start and end
            name = f"of which {part:.1f} s from {name}" if part >= 0.2 * seconds else ""
        parts.append(f"{SHORT[cause]} {seconds:.1f} s" + (f" ({name})" if name else ""))
    if not parts:
        return head + "; no badput"
    faults = f", {len(gp.faults)} fault(s)" if gp.faults else ""
    return f"{head}; badput {bad:.1f} worker-s{faults}: " + ", ".join(parts)


def format_breakdown(gp: Goodput) -> str:
    """``elastrun goodput``'s table: causes in worker-seconds and wall seconds, then each fault's cost."""
    lines = [f"job {gp.run_id}: {gp.wall:.1f} s wall, {gp.slots} worker slot(s), {gp.device_seconds:.1f} worker-s"
             + (" (running: measured so far)" if gp.live else ""),
             f"goodput: {_pct(gp.ratio)} of worker-seconds ({gp.good:.1f} s), {_pct(gp.wall_ratio)} of wall time "
             f"({gp.wall_good:.1f} s); measured from {gp.basis}", ""]
    rows = [["cause", "worker-s", "%", "wall s", "%"],
            ["goodput", f"{gp.good:.1f}", _pct(gp.ratio), f"{gp.wall_good:.1f}", _pct(gp.wall_ratio)]]
    for c in CAUSES:
        if gp.badput[c] < 0.005 and gp.wall_badput[c] < 0.005:
            continue
        share = gp.badput[c] / gp.device_seconds if gp.device_seconds else None
        wall_share = gp.wall_badput[c] / gp.wall if gp.wall else None
        rows.append([CAUSE_LABELS[c], f"{gp.badput[c]:.1f}", _pct(share), f"{gp.wall_badput[c]:.1f}",
                     _pct(wall_share)])
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        lines.append("  ".join([r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in range(1, 5)]).rstrip())
    if gp.restore_sources:
        lines.append("restores: " + ", ".join(f"{s} {v:.1f} worker-s" for s, v in sorted(gp.restore_sources.items())))
    if gp.snapshots is not None:
        every, step_s, cost_s = gp.snapshots
        share = f" = {cost_s / every / step_s * 100:.1f} % of a {step_s * 1e3:.1f} ms step" if step_s > 0 else ""
        lines.append(f"snapshots: every {every} step(s), chosen from their measured cost ({cost_s * 1e3:.1f} ms "
                     f"each{share})")
    lines.append("")
    if not gp.faults:
        lines.append("faults: none")
    for f in gp.faults:
        detect = f"detected after {f.detected - f.at:.2f} s"
        back = f", stepping again after {f.back - f.at:.2f} s" if f.back is not None else ""
        cost = ", ".join(f"{SHORT[c]} {v:.1f}" for c, v in sorted(f.cost.items(), key=lambda cv: -cv[1]) if v >= 0.05)
        lines.append(f"fault {f.index + 1} at {f.at - gp.start:.1f} s: {f.label}; {detect}{back}; "
                     f"cost {f.total:.1f} worker-s" + (f" ({cost})" if cost else ""))
    return "\n".join(lines)


def to_json(gp: Goodput, spans: bool = False) -> dict[str, Any]:
    """The breakdown as a JSON-ready document (``elastrun goodput --json``; ``spans`` adds every interval)."""
    doc: dict[str, Any] = {
        "run_id": gp.run_id, "start": gp.start, "end": gp.end, "wall_seconds": round(gp.wall, 4),
        "slots": gp.slots, "worker_seconds": round(gp.device_seconds, 4), "basis": gp.basis, "live": gp.live,
        "goodput_ratio": None if gp.ratio is None else round(gp.ratio, 6),
        "goodput_seconds": round(gp.good, 4),
        "wall_goodput_ratio": None if gp.wall_ratio is None else round(gp.wall_ratio, 6),
        "wall_goodput_seconds": round(gp.wall_good, 4),
        "badput_seconds": {c: round(v, 4) for c, v in gp.badput.items()},
        "wall_badput_seconds": {c: round(v, 4) for c, v in gp.wall_badput.items()},
        "restore_sources": {s: round(v, 4) for s, v in gp.restore_sources.items()},
        "faults": [{"index": f.index, "kind": f.kind, "label": f.label, "at": f.at, "detected": f.detected,
                    "back": f.back, "round": f.round, "node": f.node, "rank": f.rank,
                    "cost_seconds": {c: round(v, 4) for c, v in f.cost.items()}, "total_seconds": round(f.total, 4)}
                   for f in gp.faults],
        "summary": summary_line(gp),
    }
    if spans:
        doc["spans"] = [{"node": s.node, "slot": s.slot, "start": s.start, "end": s.end, "cause": s.cause,
                         "fault": s.fault, "detail": s.detail, "commit_inside": round(s.inner, 6)} for s in gp.spans]
    return doc


class GoodputTracker:
    """Keeps an agent's events (an ``EventLog`` listener) to compute its goodput at any time.

    Use (what the agent does)::

        tracker = GoodputTracker(step_dirs=[log_dir])
        events.add_listener(tracker)
        ...
        console.info(tracker.summary_line())   # at the end of the job

    ``step_dirs`` are searched for the workers' step records (their attempt directories).
    """

    def __init__(self, step_dirs: list[Path] | None = None) -> None:
        self.step_dirs = list(step_dirs or [])
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)

    def add_step_dir(self, path: Path) -> None:
        """Also look for step records under ``path`` (e.g. the agent's own attempt directory)."""
        if path not in self.step_dirs:
            self.step_dirs.append(path)

    def compute(self, now: float | None = None) -> Goodput | None:
        """Goodput of this node so far (None before the first event)."""
        with self._lock:
            events = list(self._events)
        if not events:
            return None
        ended = any(e.get("event") == "agent_exit" for e in events)
        return compute(events, read_logs(self.step_dirs), now=None if ended else (now or time.time()))

    def summary_line(self) -> str:
        """The end-of-job line (see :func:`summary_line`); never raises: goodput must not fail a job.

        An agent sees its own node's events only: in a job of several nodes the line says that it is
        this node's figure (``elastrun goodput`` on the shared log directory gives the job's).
        """
        try:
            gp = self.compute()
        except Exception as exc:  # noqa: BLE001 - a summary is not worth an exit code
            return f"goodput not computed: {exc}"
        if gp is None:
            return "goodput not measured: no events"
        with self._lock:
            nodes = max((len(e.get("members") or ()) for e in self._events if e.get("event") == "round_closed"),
                        default=1)
        return f"this node's {summary_line(gp)}" if nodes > 1 else summary_line(gp)
