"""The soak: one elastic job kept running for a long time under steady churn, every resource that
could leak sampled, and the slope of each reported (target: flat).

    .venv/bin/python bench/bench_soak.py --backend c10d --minutes 30 \
        --report docs/soak.md --plot docs/soak-c10d.png

The job is the chaos trainer (``tests/chaos/trainer.py``, a small MLP with ``elastrun.train``,
through ``et.run`` unless ``--plain``) under real agents (``--nnodes=3:4``, one worker each, the
warm pool, default flags otherwise), on c10d or on a 3-member etcd cluster on loopback.  Nodes 0
and 1 are never removed (node 0 hosts the c10d store), so their agents live the whole run; nodes 2
and 3 churn.  Every 15-30 s (``--change-every``) one membership change, drawn at random:

* node loss: a churning node's agent is SIGKILLed (its workers die with it), and
* pre-emption: a churning node's agent gets SIGTERM (workers checkpoint and exit within the
  agent's grace), each followed by the node's
* join: a new agent for that node slot (the next change, when a node is down);
* worker crash: any worker SIGKILLed.

Every ``--sample-every`` seconds it samples, for every live agent and each of its descendants
(the pool's template, the workers): resident memory, open descriptors, threads; for each agent
its number of child processes; the rendezvous store's key count (c10d: ``TCPStore.num_keys()``
through a client of the job's store) or the job's keys and the cluster's leases (etcd); and the
job's ``/dev/shm`` usage (bytes and entries of the runtime directories whose ``owner.pid`` names
one of the job's agents, live or dead).  After a warm-up (``--warmup``, excluded), each series of
a process that lived through most of the rest of the run, and each job-wide series, is flat when
the median of its last quarter exceeds that of its first by no more than its bound in
:data:`BOUNDS`; the report gives the least-squares slope too (per hour, per 100 rounds).  Saved
samples (``--json``) can be analysed and plotted again (``--from-json``).  At the end the job is
released and must end with exit 0, and the chaos invariants are checked on it (samples once per
epoch, complete steps, no committed step lost, identical parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.chaos import records, verify  # noqa: E402
from tests.chaos.harness import ChaosJob, JobSpec  # noqa: E402

PERMANENT = (0, 1)
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


class Soak:
    """Runs the job, the churn and the sampling; see the module docstring."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        spec = JobSpec(backend=args.backend, seed=args.seed, nodes=4, min_nodes=3, reform=not args.plain,
                       samples=args.samples, pace=args.pace, fault_timeout=120.0, end_timeout=180.0)
        self.job = ChaosJob(spec)
        self.series: dict[tuple[str, str], Series] = {}
        self.changes: list[tuple[float, str, int]] = []
        self.agent_pids: set[int] = set()
        self.births: dict[int, float] = {}
        self.t0 = 0.0
        self.store: Any = None
        self.loads: list[float] = []
        self.steps = 0
        self.worker_pids: set[int] = set()
        #: Sample times at which every node was up: job-wide series are fitted on these only (they
        #: follow the membership: a down node's runtime directory and heartbeat key are gone).
        self.full: set[float] = set()

    # ------------------------------------------------------------------ churn
    def start(self) -> None:
        self.job.__enter__()
        self.job.start()
        self.t0 = time.time()
        for node in self.job.nodes:
            self._note_agent(node)
        self.job._wait(lambda: self.job.steady(0.0, 3), 180, "the first steps")

    def _note_agent(self, node) -> None:
        if node.proc is not None:
            self.agent_pids.add(node.proc.pid)

    def change(self) -> None:
        """One membership change (see the module docstring)."""
        job = self.job
        down = [n for n in job.nodes if n.state == "down"]
        if down:
            node = down[0]
            if node.proc is not None and node.proc.poll() is None:
                node.proc.wait(60)  # a pre-empted agent still leaving
            job.start_node(node)
            self._note_agent(node)
            self.changes.append((time.time(), "join", node.index))
            return
        kind = self.rng.choice(["node_loss", "preemption", "worker_crash"])
        if kind == "worker_crash":
            node = self.rng.choice(job.up_nodes())
            pids = job.worker_pids(node)
            if not pids:
                return
            os.kill(self.rng.choice(pids), signal.SIGKILL)
            self.changes.append((time.time(), kind, node.index))
            return
        node = self.rng.choice([n for n in job.up_nodes() if n.index not in PERMANENT])
        assert node.proc is not None
        job.node_id(node)
        node.state = "down"
        os.kill(node.proc.pid, signal.SIGKILL if kind == "node_loss" else signal.SIGTERM)
        self.changes.append((time.time(), kind, node.index))

    # ------------------------------------------------------------------ sampling
    def _add(self, name: str, metric: str, t: float, rnd: int, value: float) -> None:
        key = (name, metric)
        if key not in self.series:
            self.series[key] = Series(name, metric)
        self.series[key].points.append((t, rnd, value))

    def rounds(self) -> int:
        return len({e["round"] for e in self.job.events() if e["event"] == "round_closed"})

    def sample(self) -> None:
        t = time.time() - self.t0
        events = self.job.events()
        rnd = len({e["round"] for e in events if e["event"] == "round_closed"})
        self.worker_pids = {e["pid"] for e in events if e["event"] == "worker_start"}
        if all(n.state == "up" for n in self.job.nodes):
            self.full.add(t)
        self.job.track()
        for node in self.job.nodes:
            proc = node.proc
            if proc is None or proc.poll() is not None:
                continue
            try:
                agent = psutil.Process(proc.pid)
                kids = agent.children(recursive=True)
            except psutil.Error:
                continue
            tag = f"agent {proc.pid} (node {node.index})"
            self._proc(tag, agent, t, rnd)
            self._add(tag, "children", t, rnd, len(kids))
            for kid in kids:
                self._proc(f"{self._role(kid)} {kid.pid} (node {node.index})", kid, t, rnd)
        self._store(t, rnd)
        shm_bytes, shm_entries = self._shm()
        self._add("job", "shm_bytes", t, rnd, shm_bytes / 2**20)
        self._add("job", "shm_entries", t, rnd, shm_entries)
        self.loads.append(os.getloadavg()[0])
        self.job.steps.refresh()
        self.steps = max((r["s"] for r in self.job.steps.records), default=0)
        self._add("job", "steps", t, rnd, self.steps)

    def _role(self, proc: psutil.Process) -> str:
        """``worker`` for a process the agents started as one (their ``worker_start`` events), else
        ``template`` (the warm pool's, which forks the workers)."""
        return "worker" if proc.pid in self.worker_pids else "template"

    def _proc(self, tag: str, proc: psutil.Process, t: float, rnd: int) -> None:
        try:
            with proc.oneshot():
                rss = proc.memory_info().rss / 2**20
                fds = proc.num_fds()
                threads = proc.num_threads()
        except psutil.Error:
            return
        self.births.setdefault(proc.pid, t)
        self._add(tag, "rss", t, rnd, rss)
        self._add(tag, "fds", t, rnd, fds)
        self._add(tag, "threads", t, rnd, threads)

    def _store(self, t: float, rnd: int) -> None:
        if self.args.backend == "c10d":
            import torch.distributed as dist

            try:
                if self.store is None:
                    host, port = self.job.endpoint.rsplit(":", 1)
                    self.store = dist.TCPStore(host, int(port), is_master=False,
                                               timeout=__import__("datetime").timedelta(seconds=5))
                self._add("job", "store_keys", t, rnd, self.store.num_keys())
            except Exception as exc:  # the store is gone: the job ended
                print(f"soak: store not readable: {exc}", file=sys.stderr)
            return
        try:
            self._add("job", "etcd_keys", t, rnd, len(self.job.etcd.list_keys(f"/elastrun/{self.job.run_id}/")))
            self._add("job", "etcd_leases", t, rnd, self._leases())
        except Exception as exc:
            print(f"soak: etcd not readable: {exc}", file=sys.stderr)

    def _leases(self) -> int:
        import urllib.request

        for i in range(3):
            try:
                req = urllib.request.Request(f"http://{self.job.etcd.endpoint(i)}/v3/lease/leases", data=b"{}",
                                             method="POST")
                with urllib.request.urlopen(req, timeout=3) as resp:
                    return len(json.loads(resp.read()).get("leases", []))
            except OSError:
                continue
        raise RuntimeError("no etcd member answered the lease list")

    def _shm(self) -> tuple[int, int]:
        """Bytes (allocated) and entries under the runtime directories of the job's agents."""
        total = entries = 0
        for d in Path("/dev/shm").glob("elastrun-*"):
            try:
                owner = int((d / "owner.pid").read_text())
            except (OSError, ValueError):
                continue
            if owner not in self.agent_pids:
                continue
            for root, dirs, files in os.walk(d):
                for name in dirs + files:
                    entries += 1
                    try:
                        total += os.lstat(os.path.join(root, name)).st_blocks * 512
                    except OSError:
                        pass
        return total, entries

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        a = self.args
        lo, hi = (float(x) for x in a.change_every.split(":"))
        end = time.time() + a.minutes * 60
        self.start()
        next_change = time.time() + self.rng.uniform(lo, hi)
        next_sample = time.time()
        print(f"soak: {a.backend}, {a.minutes:g} min, job {self.job.run_id}, work {self.job.work}", flush=True)
        while time.time() < end:
            now = time.time()
            if now >= next_sample:
                self.sample()
                next_sample = now + a.sample_every
            if now >= next_change:
                self.change()
                last = self.changes[-1] if self.changes else None
                print(f"soak: {now - self.t0:7.1f} s  {last}  steps {self.steps}  load {os.getloadavg()[0]:.1f}",
                      flush=True)
                next_change = now + self.rng.uniform(lo, hi)
            time.sleep(0.2)
        if any(n.state == "down" for n in self.job.nodes):
            self.change()  # capacity back before the end
        since = time.time()
        self.job._wait(lambda: self.job.steady(since, 3), 180, "steady training before the end")
        self.sample()
        codes = self.job.finish()
        return self.verdicts(codes)

    def verdicts(self, codes: list[int | None]) -> dict[str, Any]:
        job = self.job
        job.steps.refresh()
        steps = records.committed(job.steps.records)
        restored = records.restores(job.out)
        checks = [
            verify.Check("job finished", (job.out / "final.json").exists() and all(c == 0 for c in codes),
                         f"exit codes {codes}"),
            verify.samples_once(steps, self.args.samples),
            verify.complete_steps(steps),
            verify.no_step_lost(job.steps.records, restored),
            verify.same_parameters(steps, restored, job.steps.records),
        ]
        return {"codes": codes, "checks": [c.__dict__ for c in checks], "steps": len(steps),
                "rounds": self.rounds(), "restores": len(restored)}

    def close(self) -> None:
        self.store = None
        self.job.cleanup()


# ---------------------------------------------------------------------------------- analysis
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
        f"### {args.backend}{' (plain loop)' if args.plain else ' (et.run)'}: {wall / 60:.1f} min, "
        f"{outcome['rounds']} rounds, {len(changes)} changes",
        "",
        f"`{data['command']}` on {data['date']}; "
        f"load average (1 min) median {statistics.median(loads):.1f}, max {max(loads):.1f} on "
        f"{os.cpu_count()} CPUs (the machine was shared{' and the run held the quiet lock' if args.quiet else ''}).",
        "",
        f"Changes: {', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))}; {outcome['steps']} committed steps, "
        f"{outcome['restores']} restores.  End: exit codes {outcome['codes']}; invariants: "
        + "; ".join(f"{c['name']} {'held' if c['ok'] else 'VIOLATED: ' + c['detail']}" for c in checks) + ".",
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("c10d", "etcd"), default="c10d")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--change-every", default="15:30", help="seconds between changes, MIN:MAX (default 15:30)")
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=120.0, help="seconds excluded from the fits (default 120)")
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--pace", type=float, default=0.1, help="seconds each step sleeps (default 0.1)")
    p.add_argument("--plain", action="store_true", help="the plain training loop instead of et.run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--report", default=None, help="markdown file whose section for this backend is (re)written")
    p.add_argument("--plot", default=None, help="PNG of every series")
    p.add_argument("--json", default=None, help="every sample, as JSON")
    p.add_argument("--quiet", action="store_true", help="say in the report that the run held the quiet lock")
    p.add_argument("--from-json", default=None, help="analyse (and plot) the samples a --json run saved, again")
    a = p.parse_args(argv)
    lo, _, hi = a.change_every.partition(":")
    if not lo or not hi or not 0 < float(lo) <= float(hi):
        p.error("--change-every takes MIN:MAX seconds, 0 < MIN <= MAX")
    if a.minutes * 60 <= a.warmup + 60:
        p.error("--minutes must leave at least a minute after --warmup")
    if a.from_json:  # analyse and plot a finished run again
        data = json.loads(Path(a.from_json).read_text())
    else:
        data = run_soak(a)
        if a.json:
            Path(a.json).write_text(json.dumps(data))
    series = {(x["name"], x["metric"]): Series(x["name"], x["metric"], [tuple(p) for p in x["points"]])
              for x in data["series"]}
    span_end = max(pt[0] for s in series.values() for pt in s.points)
    rows = analyse(series, a.warmup, span_end - 30, set(data["full"]))
    title = f"elastrun soak, {a.backend}{' plain loop' if a.plain else ' et.run'}, {data['wall'] / 60:.0f} min"
    if a.plot:
        plot(series, data["changes"], a.warmup, Path(a.plot), title)
    text = render(a, data, rows, a.plot)
    print(text)
    if a.report:
        write_section(Path(a.report), a.backend, text)
    ok = all(c["ok"] for c in data["outcome"]["checks"]) and all(r["flat"] for r in rows)
    return 0 if ok else 1


def run_soak(a: argparse.Namespace) -> dict[str, Any]:
    """Run the soak; everything the report needs, as plain data (what ``--json`` saves)."""
    soak = Soak(a)
    started = time.monotonic()
    try:
        outcome = soak.run()
    finally:
        soak.close()
    return {
        "series": [{"name": s.name, "metric": s.metric, "points": s.points} for s in soak.series.values()],
        "changes": [(t - soak.t0, k, n) for t, k, n in soak.changes], "outcome": outcome,
        "full": sorted(soak.full), "loads": soak.loads, "wall": time.monotonic() - started,
        "command": " ".join(["bench/bench_soak.py", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


if __name__ == "__main__":
    sys.exit(main())
