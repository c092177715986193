"""The soak: one elastic job kept running for a long time under steady churn, every resource that
could leak sampled, and the slope of each reported (target: flat).

    .venv/bin/python bench/bench_soak.py --backend c10d --minutes 30 \
        --report docs/soak.md --plot docs/soak-c10d.png

The job is the chaos trainer (``tests/chaos/trainer.py``, a small MLP with ``elastrun.train``,
through ``et.run`` unless ``--plain``; with ``--sharded`` its model is sharded by FSDP2, so every
rank snapshots its own shard and every restore reshards) under real agents (``--nnodes=3:4``, one worker each, the
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
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soak_report import Series, add_run, analyse, plot, render, write_section  # noqa: E402
from tests.chaos import records, verify  # noqa: E402
from tests.chaos.harness import ChaosJob, JobSpec  # noqa: E402

PERMANENT = (0, 1)


class Soak:
    """Runs the job, the churn and the sampling; see the module docstring."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        spec = JobSpec(backend=args.backend, seed=args.seed, nodes=4, min_nodes=3, reform=not args.plain,
                       sharded=args.sharded,
                       samples=args.samples, pace=args.pace, fault_timeout=120.0, end_timeout=180.0,
                       stall_after=args.stall_after)
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
        #: Agents that exited without being told (``"node N (pid P): exit code C at T s"``): findings.
        self.self_exits: list[str] = []

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
            try:
                os.kill(self.rng.choice(pids), signal.SIGKILL)
            except ProcessLookupError:  # it ended between the listing and the kill (a restart): no change
                return
            self.changes.append((time.time(), kind, node.index))
            return
        node = self.rng.choice([n for n in job.up_nodes() if n.index not in PERMANENT])
        assert node.proc is not None
        if self._exited(node):  # gone by itself: a finding (see :meth:`watch`), not this change
            return
        job.node_id(node)
        node.state = "down"
        os.kill(node.proc.pid, signal.SIGKILL if kind == "node_loss" else signal.SIGTERM)
        self.changes.append((time.time(), kind, node.index))

    def _exited(self, node) -> bool:
        """Whether an up node's agent has exited without being told to: said once, as a finding."""
        code = node.proc.poll() if node.proc is not None else None
        if node.state != "up" or code is None:
            return False
        what = f"the agent of node {node.index} (pid {node.proc.pid}) exited by itself with code {code} " \
               f"at {time.time() - self.t0:.0f} s"
        self.self_exits.append(what)
        node.state = "down"  # the next change brings the node back
        self.job.snapshot(what)
        return True

    def watch(self) -> bool:
        """Between changes: a stall (its stacks taken the moment it is seen, by the harness) and agents
        that exited by themselves; False when the run cannot go on (a permanent node's agent is gone)."""
        self.job.watch_stall("the next change")
        gone = [node.index for node in self.job.nodes if self._exited(node)]
        return not set(gone) & set(PERMANENT)

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
        next_watch = 0.0
        while time.time() < end:
            now = time.time()
            if now >= next_watch:
                if not self.watch():
                    break
                next_watch = now + 1.0
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
        try:
            self.job._wait(lambda: self.job.steady(since, 3), 180, "steady training before the end")
        except (TimeoutError, RuntimeError) as exc:  # a finding with its evidence, not the bench's crash
            self.job.snapshot(f"no steady training before the end: {exc}")
        self.sample()
        codes = self.job.finish()
        return self.verdicts(codes)

    def verdicts(self, codes: list[int | None], failure: str | None = None) -> dict[str, Any]:
        """Every check of the run (``failure``: why the run itself could not go on, a check too)."""
        job = self.job
        job.steps.refresh()
        steps = records.committed(job.steps.records)
        restored = records.restores(job.out)
        events = job.events()
        judged = [f"{e['event']} on {e['node']}: {e.get('reason', '')[:160]}" for e in events
                  if e["event"] in ("stall", "hang_detected")]
        stalls = [f for f in job.findings if " stall: " in f" {f} "]
        gaps = verify.step_gaps(job.steps.records, self.args.stall_after)
        checks = [
            *([verify.Check("soak ran to its end", False, failure)] if failure else []),
            verify.Check("job finished", (job.out / "final.json").exists() and all(c == 0 for c in codes),
                         f"exit codes {codes}"),
            verify.Check("no stall", not stalls and not gaps,
                         "; ".join([*stalls, *gaps][:4]) or f"no {self.args.stall_after:g} s without a committed step"),
            verify.Check("no agent exited by itself", not self.self_exits, "; ".join(self.self_exits[:4]) or "none"),
            verify.Check("no worker judged hung or stalled (none was made to hang)", not judged,
                         "; ".join(judged[:3]) or "none"),
            verify.samples_once(steps, self.args.samples),
            verify.complete_steps(steps),
            verify.no_step_lost(job.steps.records, restored),
            verify.same_parameters(steps, restored, job.steps.records),
        ]
        bad = [c for c in checks if not c.ok]
        if bad:  # the clean-up keeps the work directory, with the reasons
            job.findings.append("violated: " + "; ".join(f"{c.name}: {c.detail[:300]}" for c in bad))
        times = sorted(r["t"] for r in job.steps.records)
        longest = max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)
        return {"codes": codes, "checks": [c.__dict__ for c in checks], "steps": len(steps),
                "rounds": self.rounds(), "restores": len(restored), "stalls": len(stalls) + len(gaps),
                "longest_gap": longest, "self_exits": self.self_exits, "judged": judged}

    def close(self) -> None:
        self.store = None
        self.job.cleanup()
        if self.job.kept is not None:
            print(f"soak: evidence kept: {self.job.kept}", flush=True)


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
    p.add_argument("--sharded", action="store_true", help="the model sharded with FSDP2 (fully_shard)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stall-after", type=float, default=30.0,
                   help="seconds without a committed step that make a stall, a failure (default 30)")
    p.add_argument("--runs", default=None, help="markdown file whose table of runs gets this run's row")
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
    span_end = max((pt[0] for s in series.values() for pt in s.points), default=0.0)
    rows = analyse(series, a.warmup, span_end - 30, set(data["full"])) if series else []
    title = (f"elastrun soak, {a.backend}{' plain loop' if a.plain else ' et.run'}{', FSDP2' if a.sharded else ''}, "
             f"{data['wall'] / 60:.0f} min")
    if a.plot:
        plot(series, data["changes"], a.warmup, Path(a.plot), title)
    text = render(a, data, rows, a.plot)
    print(text)
    if a.report:
        write_section(Path(a.report), f"{a.backend}-fsdp2" if a.sharded else a.backend, text)
    if a.runs:
        add_run(Path(a.runs), a, data)
    ok = all(c["ok"] for c in data["outcome"]["checks"]) and all(r["flat"] for r in rows)
    return 0 if ok else 1


def run_soak(a: argparse.Namespace) -> dict[str, Any]:
    """Run the soak; everything the report needs, as plain data (what ``--json`` saves)."""
    soak = Soak(a)
    started = time.monotonic()
    try:
        try:
            outcome = soak.run()
        except (TimeoutError, RuntimeError) as exc:  # e.g. no first steps: a finding with its evidence
            soak.job.snapshot(f"the soak could not go on: {exc}")
            outcome = soak.verdicts(soak.job.finish(), failure=str(exc))
    finally:
        soak.close()
    return {
        "series": [{"name": s.name, "metric": s.metric, "points": s.points} for s in soak.series.values()],
        "changes": [(t - soak.t0, k, n) for t, k, n in soak.changes], "outcome": outcome,
        "full": sorted(soak.full), "loads": soak.loads, "wall": time.monotonic() - started,
        "evidence": str(soak.job.kept) if soak.job.kept else None, "commit": _commit(),
        "command": " ".join(["bench/bench_soak.py", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def _commit() -> str:
    """The code's commit (with ``+`` when the work tree differs from it); for a copy of the code that is
    no git checkout (``git archive``, so that a long soak runs code that does not change under it),
    ``$SOAK_CODE``, else ``?``."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("SOAK_CODE", "?")
    if head.returncode != 0 or not head.stdout.strip():
        return os.environ.get("SOAK_CODE", "?")
    return head.stdout.strip() + ("+" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
