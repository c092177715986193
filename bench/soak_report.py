"""The soak's analysis and report: the fitted trend of every sampled series, its plot, the markdown
section of docs/soak.md, and the table of runs (one row per run: stalls, violations, exits).

See ``bench/bench_soak.py`` for the run itself and docs/soak.md for what the verdicts mean.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Largest growth over the measured span that still counts as flat, per metric (and its unit).  RSS
#: moves with the allocator's arenas and Python's free lists; a leak of one object per round shows
#: only over many rounds, hence bounds on the fitted trend, not on single samples.
BOUNDS: dict[str, tuple[float, str]] = {
    "rss": (4.0, "MiB"),
    "worker_rss_max": (4.0, "MiB"),
    "worker_fds_max": (1.0, "descriptors"),
    "worker_threads_max": (1.0, "threads"),
    "fds": (1.0, "descriptors"),
    "threads": (1.0, "threads"),
    "children": (1.0, "processes"),
    "store_keys": (2.0, "keys"),
    "etcd_keys": (2.0, "keys"),
    "etcd_leases": (1.0, "leases"),
    "shm_bytes": (1.0, "MiB"),
    "shm_entries": (2.0, "entries"),
}


@dataclass
class Series:
    """One metric of one process (or of the job) over time: ``(t, round, value)`` points."""

    name: str
    metric: str
    points: list[tuple[float, int, float]] = field(default_factory=list)


def fit(points: list[tuple[float, int, float]]) -> tuple[float, float]:
    """Least-squares slopes of value against time (per second) and against rounds (per round)."""

    def slope(xs: list[float], ys: list[float]) -> float:
        if len(xs) < 3 or max(xs) == min(xs):
            return 0.0
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        den = sum((x - mx) ** 2 for x in xs)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den

    ts = [p[0] for p in points]
    rs = [float(p[1]) for p in points]
    vs = [p[2] for p in points]
    return slope(ts, vs), slope(rs, vs)


def workers_max(series: dict[tuple[str, str], Series]) -> dict[tuple[str, str], Series]:
    """Job-wide series of the largest RSS, descriptor and thread count over the live workers at each
    sample: no worker lives through a whole soak (crashes hit them), but the oldest one carries
    whatever re-forms leave behind."""
    out = {}
    for metric in ("rss", "fds", "threads"):
        at: dict[float, tuple[int, float]] = {}
        for (name, m), s in series.items():
            if m == metric and name.startswith("worker"):
                for t, rnd, v in s.points:
                    at[t] = (rnd, max(v, at.get(t, (rnd, v))[1]))
        if at:
            out[("job", f"worker_{metric}_max")] = Series("job", f"worker_{metric}_max",
                                                          [(t, rnd, v) for t, (rnd, v) in sorted(at.items())])
    return out


def analyse(series: dict[tuple[str, str], Series], warmup: float, span_end: float,
            full: set[float]) -> list[dict[str, Any]]:
    """One row per (process or job, metric) that covers the measured span, with its fitted growth;
    job-wide series only on the samples taken while every node was up (``full``)."""
    rows = []
    series = {**series, **workers_max(series)}
    for (name, metric), s in sorted(series.items()):
        if metric not in BOUNDS:
            continue
        # A process is fitted after its own warm-up too (a joiner's agent imports torch, a new
        # worker builds its model), and only if what is left covers most of the measured span.
        born = s.points[0][0]
        pts = [p for p in s.points if p[0] >= max(warmup, born + warmup) and (name != "job" or p[0] in full)]
        if len(pts) < 5:
            continue
        first, last = pts[0][0], pts[-1][0]
        if last - first < 0.8 * (span_end - warmup):  # not alive through most of the measured span
            continue
        per_s, per_round = fit(pts)
        rounds = pts[-1][1] - pts[0][1]
        growth = per_s * (last - first)
        # The verdict: the median of the last quarter of the span against that of the first.  Robust
        # to what these series do besides leaking: integers that flicker with the membership (a
        # descriptor per connected agent) and one-time steps (an allocator arena); a leak moves it by
        # three quarters of its growth over the span.
        q = (last - first) / 4
        late_growth = (statistics.median(p[2] for p in pts if p[0] >= last - q)
                       - statistics.median(p[2] for p in pts if p[0] <= first + q))
        bound, unit = BOUNDS[metric]
        rows.append({
            "name": name, "metric": metric, "unit": unit, "samples": len(pts),
            "start": statistics.median(p[2] for p in pts[: max(3, len(pts) // 10)]),
            "end": statistics.median(p[2] for p in pts[-max(3, len(pts) // 10):]),
            "min": min(p[2] for p in pts), "max": max(p[2] for p in pts),
            "per_hour": per_s * 3600, "per_100_rounds": per_round * 100, "rounds": rounds,
            "growth": growth, "late_growth": late_growth, "bound": bound, "flat": late_growth <= bound,
        })
    return rows


def plot(series: dict[tuple[str, str], Series], changes: list[tuple[float, str, int]], warmup: float,
         path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("agent", "rss", "agents: resident memory (MiB)"), ("agent", "fds", "agents: open descriptors"),
        ("agent", "threads", "agents: threads"), ("agent", "children", "agents: child processes"),
        ("worker", "rss", "workers: resident memory (MiB)"), ("worker", "fds", "workers: open descriptors"),
        ("job", "store", "rendezvous store: keys (and etcd leases)"), ("job", "shm", "job's /dev/shm (MiB, entries)"),
    ]
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5), sharex=True)
    colours = {"node_loss": "tab:red", "preemption": "tab:orange", "join": "tab:green", "worker_crash": "tab:purple"}
    for ax, (who, metric, label) in zip(axes.flat, panels, strict=True):
        for (name, m), s in sorted(series.items()):
            if who == "job":
                if metric == "store" and m in ("store_keys", "etcd_keys", "etcd_leases"):
                    ax.plot([p[0] / 60 for p in s.points], [p[2] for p in s.points], label=m.replace("_", " "))
                elif metric == "shm" and m.startswith("shm_"):
                    ax.plot([p[0] / 60 for p in s.points], [p[2] for p in s.points],
                            label="MiB" if m == "shm_bytes" else "entries")
                continue
            if m != metric or not name.startswith(who):
                continue
            ax.plot([p[0] / 60 for p in s.points], [p[2] for p in s.points], lw=1,
                    label=name if len(s.points) * 3 > max(len(x.points) for x in series.values()) else None)
        for t, kind, _node in changes:
            ax.axvline(t / 60, color=colours.get(kind, "grey"), alpha=0.15, lw=0.8)
        ax.axvspan(0, warmup / 60, color="grey", alpha=0.08)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles and len(handles) <= 6:
            ax.legend(fontsize=7, loc="best")
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    fig.suptitle(title + "   (vertical lines: red node loss, orange pre-emption, green join, purple worker crash; "
                 "grey band: warm-up, not fitted)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def render(args: argparse.Namespace, data: dict[str, Any], rows: list[dict[str, Any]], plot_path: str | None) -> str:
    outcome, wall, loads, changes = data["outcome"], data["wall"], data["loads"], data["changes"]
    kinds: dict[str, int] = {}
    for _t, kind, _n in changes:
        kinds[kind] = kinds.get(kind, 0) + 1
    bad = [r for r in rows if not r["flat"]]
    checks = outcome["checks"]
    lines = [
        f"### {args.backend}{' (plain loop' if args.plain else ' (et.run'}{', FSDP2)' if args.sharded else ')'}: "
        f"{wall / 60:.1f} min, "
        f"{outcome['rounds']} rounds, {len(changes)} changes",
        "",
        f"`{data['command']}` on {data['date']}; "
        f"load average (1 min) median {statistics.median(loads or [0.0]):.1f}, max {max(loads or [0.0]):.1f} on "
        f"{os.cpu_count()} CPUs (the machine was shared{' and the run held the quiet lock' if args.quiet else ''}).",
        "",
        f"Changes: {', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))}; {outcome['steps']} committed steps, "
        f"{outcome['restores']} restores; longest time without a committed step "
        f"{outcome.get('longest_gap', 0.0):.1f} s.  End: exit codes {outcome['codes']}; invariants: "
        + "; ".join(f"{c['name']} {'held' if c['ok'] else 'VIOLATED: ' + c['detail']}" for c in checks) + "."
        + (f"  Evidence kept in `{data['evidence']}`." if data.get("evidence") else ""),
        "",
        f"**{len(rows) - len(bad)} of {len(rows)} series flat**: over the {rows[0]['rounds'] if rows else 0} "
        f"rounds after the {args.warmup:g}-s warm-up, the median of the last quarter exceeds that of the first "
        "by no more than the bound.  The least-squares slope is given too (per hour, per 100 rounds, and the "
        "growth it predicts over the span).",
        "",
        "| process / job | metric | start → end (median of first / last tenth) | min-max | slope per hour | "
        "per 100 rounds | growth: fitted / last − first quarter (bound) | flat |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['metric']} ({r['unit']}) | {r['start']:.1f} → {r['end']:.1f} | "
            f"{r['min']:.1f}-{r['max']:.1f} | {r['per_hour']:+.2f} | {r['per_100_rounds']:+.2f} | "
            f"{r['growth']:+.2f} / {r['late_growth']:+.2f} ({r['bound']:g}) | {'yes' if r['flat'] else '**no**'} |")
    if plot_path:
        lines += ["", f"![soak {args.backend}]({Path(plot_path).name})"]
    return "\n".join(lines) + "\n"


def write_section(report: Path, backend: str, text: str) -> None:
    """Put ``text`` between this backend's markers in ``report`` (created with a heading if missing)."""
    begin, end = f"<!-- soak:{backend} -->", f"<!-- /soak:{backend} -->"
    doc = report.read_text() if report.exists() else "# Soak: a long run under churn\n\n"
    block = f"{begin}\n{text}{end}\n"
    if begin in doc and end in doc:
        doc = doc[: doc.index(begin)] + block + doc[doc.index(end) + len(end) + 1:]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block
    report.write_text(doc)


RUNS_BEGIN, RUNS_END = "<!-- soak:runs -->", "<!-- /soak:runs -->"
RUNS_HEADER = (
    "| date | code | backend | seed | minutes | changes | rounds | committed steps | stalls | longest without a step "
    "| violations | agents' exit codes | load median / max | evidence |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def run_row(args: argparse.Namespace, data: dict[str, Any]) -> str:
    """One row of the table of runs: what a stall hunt needs to read at a glance."""
    outcome = data["outcome"]
    bad = [c["name"] for c in outcome["checks"] if not c["ok"]]
    loads = data["loads"] or [0.0]
    return (f"| {data['date']} | {data.get('commit', '?')} | {args.backend}{' plain' if args.plain else ''}"
            f"{' FSDP2' if args.sharded else ''} | "
            f"{args.seed} | {data['wall'] / 60:.1f} | {len(data['changes'])} | {outcome['rounds']} | "
            f"{outcome['steps']} | {outcome.get('stalls', '?')} | {outcome.get('longest_gap', 0.0):.1f} s | "
            f"{len(bad)}{' (' + ', '.join(bad) + ')' if bad else ''} | {outcome['codes']} | "
            f"{statistics.median(loads):.1f} / {max(loads):.1f} | {data.get('evidence') or '-'} |\n")


def add_run(report: Path, args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Append this run's row to the table of runs in ``report`` (the table is made if missing)."""
    doc = report.read_text() if report.exists() else "# Soak: a long run under churn\n\n"
    if RUNS_BEGIN not in doc:
        doc = doc.rstrip("\n") + f"\n\n{RUNS_BEGIN}\n{RUNS_HEADER}{RUNS_END}\n"
    at = doc.index(RUNS_END)
    report.write_text(doc[:at] + run_row(args, data) + doc[at:])
