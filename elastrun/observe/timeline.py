"""``elastrun timeline``: a job's history, from the event logs of all its nodes, as a picture.

Runs in: the CLI (``elastrun timeline``).

:func:`build_timeline` turns events into a plain model (lanes, worker attempts, marks, world
size over time); :func:`render_png` draws the model with matplotlib (imported only here, with
the Agg backend, so nothing needs a display).  Keeping the model separate lets the tests check
what is plotted without reading pixels, and keeps the HTML page (:mod:`.timeline_html`) in
step with the picture.

A recovery mark stands where the restarted workers step again (the last one's first heartbeat),
not where they were spawned.  Times in the model are seconds since the job's first event.  An
attempt is one worker-group generation on one node: from its first worker's start to its last
worker's end.  Workers the agent kills for a restart leave no exit event; their attempt ends
when the agent goes round again.  An agent that was SIGKILLed leaves no more events at all: its last attempt ends when
another node declared it lost (or at the end of the log) and is drawn as ``lost``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrun.observe.goodput import compute
from elastrun.observe.timeline_goodput import (
    CAUSE_COLOURS,
    GoodputLayer,
    draw_strips,
    goodput_layer,
    legend_causes,
)
from elastrun.shared.steplog import ProcessLog

#: Outcome of an attempt → colour (colour-blind-safe palette, Okabe-Ito).
OUTCOME_COLOURS = {
    "finished": "#009E73",
    "failed": "#D55E00",
    "stopped": "#56B4E9",
    "lost": "#999999",
    "running": "#0072B2",
}
OUTCOME_LABELS = {
    "finished": "attempt finished",
    "failed": "attempt failed (a worker crashed)",
    "stopped": "attempt stopped for a new round",
    "lost": "attempt lost with its node",
    "running": "attempt still running at the end of the log",
}
#: Height of an attempt's bar in a lane (lanes are 1 apart); marks and their labels use the rest.
_BAR = 0.46
#: Mark kind → (matplotlib marker, colour, legend label).
MARK_STYLES = {
    "failure": ("X", "#D55E00", "worker failure"),
    "node_lost": ("v", "#000000", "node lost"),
    "hang": ("D", "#E69F00", "hang detected"),
    "recovered": ("^", "#009E73", "workers back: stepping again (s since the fault or change)"),
    "signal": ("s", "#CC79A7", "signal received"),
    "job_failed": ("P", "#7F0000", "job failed"),
}


@dataclass
class Attempt:
    """One generation of workers on one node."""

    node: str
    generation: int
    round: int | None
    ranks: list[int]
    start: float
    end: float
    outcome: str

    @property
    def label(self) -> str:
        ranks = sorted(self.ranks)
        span = "" if not ranks else (f"r{ranks[0]}" if len(ranks) == 1 else f"r{ranks[0]}-{ranks[-1]}")
        return f"g{self.generation} {span}".strip()


@dataclass
class Mark:
    """A point event on a node's lane (failure, loss, recovery, hang, signal)."""

    node: str
    t: float
    kind: str
    label: str
    #: Longer text for the HTML page (a failure's traceback tail, a loss's reporter).
    detail: str = ""


@dataclass
class RoundMark:
    """A round closing: when the first member saw it, its number and world size."""

    t: float
    round: int
    world_size: int
    nodes: int


@dataclass
class Timeline:
    """Everything the picture shows; built by :func:`build_timeline`."""

    run_id: str
    t0: float
    duration: float
    lanes: list[str]
    lane_labels: dict[str, str]
    attempts: list[Attempt] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    rounds: list[RoundMark] = field(default_factory=list)
    #: ``(t, WORLD_SIZE of the latest round)`` steps.
    world_size: list[tuple[float, int]] = field(default_factory=list)
    #: ``(t, workers running on all nodes)`` steps.
    running: list[tuple[float, int]] = field(default_factory=list)
    #: Worker slots per node (``--nproc-per-node`` of its agent).
    nproc: dict[str, int] = field(default_factory=dict)
    #: Every slot's time by cause and each fault's cost (None when it could not be computed).
    goodput: GoodputLayer | None = None

    def attempts_of(self, node: str) -> list[Attempt]:
        return [a for a in self.attempts if a.node == node]

    def marks_of(self, kind: str) -> list[Mark]:
        return [m for m in self.marks if m.kind == kind]


def _lane_label(node: str, start: dict[str, Any] | None) -> str:
    if start and start.get("hostname") and start.get("pid"):
        return f"{start['hostname']} pid {start['pid']}"
    return node


def build_timeline(events: list[dict[str, Any]], logs: dict[tuple[str, Any], ProcessLog] | None = None) -> Timeline:
    """The model of the picture, from the events of all nodes (any order) and the workers' step records."""
    events = sorted(events, key=lambda e: float(e.get("ts", 0.0)))
    if not events:
        raise ValueError("no events to draw")
    t0 = float(events[0]["ts"])
    t_end = float(events[-1]["ts"])
    by_node: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_node.setdefault(str(e.get("node")), []).append(e)
    starts = {n: next((e for e in evs if e.get("event") == "agent_start"), None) for n, evs in by_node.items()}
    run_id = next((str(s["run_id"]) for s in starts.values() if s and s.get("run_id")), "?")
    lost_at: dict[str, tuple[float, str]] = {}
    for e in events:
        if e.get("event") == "node_lost":
            for lost in e.get("lost") or []:
                lost_at.setdefault(str(lost), (float(e["ts"]), str(e["node"])))
    model = Timeline(
        run_id=run_id,
        t0=t0,
        duration=t_end - t0,
        lanes=list(by_node),
        lane_labels={n: _lane_label(n, starts[n]) for n in by_node},
    )
    for node, evs in by_node.items():
        _node_history(model, node, evs, lost_at.get(node), t_end)
    for node, (t, seen_by) in lost_at.items():
        if node in by_node:
            seen = model.lane_labels.get(seen_by, seen_by)
            model.marks.append(Mark(node, t - t0, "node_lost", f"lost (seen by {seen})"))
    _rounds(model, events)
    _running(model)
    model.nproc = {n: int((starts[n] or {}).get("nproc") or 1) for n in by_node}
    try:
        model.goodput = goodput_layer(compute(events, logs), t0, min_width=max(model.duration, 1.0) / 1500)
    except (ValueError, KeyError, TypeError):
        model.goodput = None  # the picture does not depend on it
    model.marks.sort(key=lambda m: m.t)
    model.attempts.sort(key=lambda a: (model.lanes.index(a.node), a.start))
    return model


def _node_history(
    model: Timeline, node: str, evs: list[dict[str, Any]], lost: tuple[float, str] | None, t_end: float
) -> None:
    t0 = model.t0
    current: dict[str, Any] | None = None

    def close(t: float, outcome: str | None = None) -> None:
        nonlocal current
        if current is None:
            return
        exits = current["exits"]
        if outcome is None:
            if current["failed"]:
                outcome = "failed"
            elif exits and len(exits) == len(current["pids"]) and all(ok for ok, _ in exits.values()):
                outcome = "finished"
            else:
                outcome = "stopped"
        end = max(t for _, t in exits.values()) if outcome == "finished" else t
        model.attempts.append(
            Attempt(node, current["generation"], current["round"], current["ranks"],
                    current["start"] - t0, max(end, current["start"]) - t0, outcome)
        )
        current = None

    exited = False
    #: generation → {rank: first heartbeat (Unix time)}, from ``worker_stepping``.
    stepping: dict[int, dict[int, float]] = {}
    #: ``recovered`` events with the generation and ranks they brought back, resolved after the loop.
    recoveries: list[tuple[dict[str, Any], int, list[int]]] = []
    for e in evs:
        kind, ts = e.get("event"), float(e["ts"])
        if kind == "worker_start":
            gen = int(e.get("generation", e.get("round", 0)) or 0)
            if current is not None and current["generation"] != gen:
                close(ts)
            if current is None:
                current = {"generation": gen, "round": e.get("round"), "ranks": [], "pids": set(),
                           "exits": {}, "failed": False, "start": ts}
            current["ranks"].append(int(e.get("rank", -1)))
            current["pids"].add(e.get("pid"))
        elif kind == "worker_exit" and current is not None:
            ok = e.get("exitcode") == 0 and not e.get("signal")
            current["exits"][e.get("pid")] = (ok, ts)
        elif kind == "worker_failure":
            if current is not None:
                current["failed"] = True
            how = f"signal {e['signal']}" if e.get("signal") else f"exit code {e.get('exitcode')}"
            model.marks.append(Mark(node, ts - t0, "failure", f"rank {e.get('rank')}: {how}",
                                    str(e.get("message") or "")[-1500:]))
        elif kind in ("round_start", "restart"):
            close(ts)
        elif kind == "worker_stepping":
            gen = int(e.get("generation", e.get("round", 0)) or 0)
            stepping.setdefault(gen, {})[int(e.get("rank", -1))] = float(e.get("first_heartbeat", ts))
        elif kind == "recovered":
            ranks = list(current["ranks"]) if current is not None else []
            recoveries.append((e, current["generation"] if current is not None else -1, ranks))
        elif kind == "hang_detected":
            model.marks.append(Mark(node, ts - t0, "hang", f"rank {e.get('rank')} silent",
                                    str(e.get("reason") or "")))
        elif kind == "signal":
            model.marks.append(Mark(node, ts - t0, "signal", str(e.get("signal", ""))))
        elif kind == "job_failed":
            model.marks.append(Mark(node, ts - t0, "job_failed", "job failed", str(e.get("reason") or "")))
        elif kind == "agent_exit":
            exited = True
            close(ts)
    if current is not None and not exited:
        if lost is not None:
            close(max(lost[0], current["start"]), "lost")
        else:
            close(t_end, "running")
    for e, gen, ranks in recoveries:
        model.marks.append(_recovery_mark(node, t0, e, stepping.get(gen, {}), ranks))


def _recovery_mark(node: str, t0: float, e: dict[str, Any], stepping: dict[int, float], ranks: list[int]) -> Mark:
    """Workers back after a fault: when the last of them sent its first heartbeat (it steps again).

    The agent's ``recovered`` event is written when the workers were started; a restart's real
    cost (imports, process-group set-up, restoring state) comes after that.  Workers that never
    send heartbeats (a script that neither uses ``elastrun.train`` nor calls
    ``elastrun.heartbeat()``) can only be shown as started, and the label says so.
    """
    ts, reason = float(e["ts"]), e.get("reason", "a fault")
    took = e.get("duration")
    if took is None:
        return Mark(node, ts - t0, "recovered", "recovered", f"recovered from {reason}")
    fault = ts - float(took)
    if ranks and all(r in stepping for r in ranks):
        back = max(stepping[r] for r in ranks)
        return Mark(node, back - t0, "recovered", f"{back - fault:.1f} s",
                    f"stepping again {back - fault:.2f} s after {reason} (started after {float(took):.2f} s)")
    return Mark(node, ts - t0, "recovered", f"{float(took):.1f} s (started)",
                f"workers started {float(took):.2f} s after {reason}; they send no heartbeats, so when they "
                "stepped again is not known")


def _rounds(model: Timeline, events: list[dict[str, Any]]) -> None:
    seen: set[int] = set()
    for e in events:
        if e.get("event") == "round_closed" and int(e.get("round", -1)) not in seen:
            seen.add(int(e["round"]))
            t = float(e["ts"]) - model.t0
            nodes = int(e.get("group_world_size") or len(e.get("members") or []))
            model.rounds.append(RoundMark(t, int(e["round"]), int(e.get("world_size", 0)), nodes))
            model.world_size.append((t, int(e.get("world_size", 0))))


def _running(model: Timeline) -> None:
    deltas: list[tuple[float, int]] = []
    for a in model.attempts:
        deltas.append((a.start, len(a.ranks)))
        deltas.append((a.end, -len(a.ranks)))
    deltas.sort(key=lambda d: (d[0], d[1]))
    count = 0
    steps: list[tuple[float, int]] = [(0.0, 0)]
    for t, d in deltas:
        count += d
        if steps and steps[-1][0] == t:
            steps[-1] = (t, count)
        else:
            steps.append((t, count))
    model.running = steps


def load_timeline(log_dir: str | Path) -> Timeline:
    """:func:`build_timeline` of every ``events-*.jsonl`` under ``log_dir``."""
    from elastrun.observe.events import event_files, read_log_dir
    from elastrun.observe.goodput_report import read_logs

    if not Path(log_dir).is_dir():
        raise FileNotFoundError(f"{log_dir} is not a directory")
    if not event_files(log_dir):
        raise FileNotFoundError(f"no events-*.jsonl files under {log_dir}; was the job run with --log-dir?")
    return build_timeline(read_log_dir(log_dir), read_logs([log_dir]))


def render_png(model: Timeline, path: str | Path, dpi: int = 120) -> Path:
    """Draw ``model`` into an image at ``path`` (PNG, SVG or PDF, by its suffix) and return the path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = model.lanes
    span = max(model.duration, 1.0)
    fig_h = 2.6 + 0.75 * len(lanes) + 1.8
    fig, (ax, ax_w) = plt.subplots(
        2, 1, figsize=(13, fig_h), sharex=True,
        gridspec_kw={"height_ratios": [max(1.6, 0.75 * len(lanes) + 0.8), 1.6], "hspace": 0.08},
    )
    y_of = {node: len(lanes) - 1 - i for i, node in enumerate(lanes)}
    for a in model.attempts:
        y = y_of[a.node]
        width = max(a.end - a.start, span * 0.002)
        ax.broken_barh([(a.start, width)], (y - _BAR / 2, _BAR), facecolors=OUTCOME_COLOURS[a.outcome],
                       edgecolors="white", linewidth=0.8)
        if width > span * 0.05:
            ax.text(a.start + width / 2, y, a.label, ha="center", va="center", fontsize=8.5, color="white",
                    fontweight="bold", clip_on=True)
    if model.goodput is not None:
        draw_strips(ax, model.goodput, y_of, model.nproc, top=_BAR / 2 + 0.03, height=0.24)
    for m in model.marks:
        # Faults sit on the bar's top edge with their label above; recoveries on the bottom edge, label below.
        marker, colour, _ = MARK_STYLES[m.kind]
        below = m.kind == "recovered"
        y = y_of[m.node] + (-_BAR / 2 if below else _BAR / 2)
        ax.plot([m.t], [y], marker=marker, color=colour, markersize=9, linestyle="none",
                markeredgecolor="white", markeredgewidth=0.8, zorder=5)
        if m.kind in ("recovered", "node_lost", "failure", "hang"):
            right = m.t > span * 0.8  # near the right edge: label to the left of the mark
            ax.text(m.t + span * (-0.006 if right else 0.006), y + (-0.06 if below else 0.06), m.label,
                    fontsize=7.5, color=colour, va="top" if below else "bottom", ha="right" if right else "left",
                    zorder=6, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5})
    for r in model.rounds:
        for axis in (ax, ax_w):
            axis.axvline(r.t, color="#bbbbbb", linewidth=0.8, linestyle=":", zorder=0)
        ax.text(r.t, len(lanes) - 0.35, f"R{r.round}", fontsize=7.5, color="#666666", ha="center", va="bottom")
    ax.set_yticks([y_of[n] for n in lanes], [model.lane_labels[n] for n in lanes], fontsize=9)
    ax.set_ylim(-0.75, len(lanes) - 0.1)
    ax.set_ylabel("node (agent)")
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    failures = len(model.marks_of("failure"))
    good = "" if model.goodput is None or model.goodput.ratio is None else \
        f", goodput {100 * model.goodput.ratio:.1f} %"
    ax.set_title(
        f"elastrun job {model.run_id}: {len(lanes)} node(s), {len(model.rounds)} round(s), "
        f"{failures} worker failure(s), {len(model.marks_of('node_lost'))} node(s) lost{good}",
        fontsize=11, loc="left",
    )
    if model.world_size:
        xs = [t for t, _ in model.world_size] + [model.duration]
        ys = [w for _, w in model.world_size] + [model.world_size[-1][1]]
        ax_w.step(xs, ys, where="post", color="#0072B2", linewidth=2, label="WORLD_SIZE of the round")
    if model.running:
        xs = [t for t, _ in model.running] + [model.duration]
        ys = [c for _, c in model.running] + [model.running[-1][1]]
        ax_w.fill_between(xs, ys, step="post", color="#56B4E9", alpha=0.35, label="workers running")
    top = max([w for _, w in model.world_size] + [c for _, c in model.running] + [1])
    ax_w.set_ylim(0, top + 1)
    ax_w.yaxis.get_major_locator().set_params(integer=True)
    ax_w.set_ylabel("workers")
    ax_w.set_xlabel("seconds since the job's first event")
    ax_w.set_xlim(-span * 0.01, span * 1.01)
    ax_w.grid(axis="both", color="#eeeeee")
    ax_w.legend(loc="lower right", fontsize=8, framealpha=0.9)
    handles = [Patch(color=OUTCOME_COLOURS[o], label=OUTCOME_LABELS[o])
               for o in OUTCOME_COLOURS if any(a.outcome == o for a in model.attempts)]
    handles += [Line2D([], [], marker=s[0], color=s[1], linestyle="none", markersize=8, label=s[2])
                for k, s in MARK_STYLES.items() if model.marks_of(k)]
    handles.append(Line2D([], [], color="#bbbbbb", linestyle=":", label="round closed (R<n>)"))
    if model.goodput is not None:
        from elastrun.observe.goodput_report import SHORT

        handles += [Patch(color=CAUSE_COLOURS[c], label=f"slot time: {'goodput' if c == 'good' else SHORT[c]}")
                    for c in legend_causes(model.goodput)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.14, right=0.78, top=0.93, bottom=0.1)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")  # keep the legend beside the axes whole
    plt.close(fig)
    return path
