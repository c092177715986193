"""Goodput is right, and shown: a job with a worker SIGKILL, a join, a hang, a node loss and a pre-emption.

The job (goodput_job.py, 1 worker per node on loopback c10d) starts on nodes A and B, then: rank 1
is SIGKILLed; node C joins; C's worker is SIGSTOPped (a hang, --hang-timeout 2); node B's agent
and worker are SIGKILLed (a lost node); node D joins and is pre-empted (SIGTERM to its agent: its
worker checkpoints and exits); the job then finishes.  The workers time their own steps,
commits and restores; ``elastrun goodput`` computes the same quantities from the agents' events
and elastrun.train's step records.  Each must agree within TOLERANCE of the job's worker-seconds
(docs/observe.md, "How accurate it is").  Once with ``et.run`` (kept processes) and once with the
plain loop (every fault restarts the workers).  The same job's ``elastrun timeline --html`` page
is then opened in headless Chromium.

Two environment variables help to study it offline: ``GOODPUT_ACCURACY_OUT=FILE`` appends each
mode's computed and seen values as a JSON line, and ``GOODPUT_KEEP_DIR=DIR`` keeps each job's files
(event logs and step records under ``logs/``, the workers' own logs under ``truth/``, the agents'
output, and ``injections.json``: the faults the test caused and when an agent first knew of each)
in ``DIR/<the job's temp dir name>``.  ``truth(read_truth(job / "truth"), [Injection(**i) for i in
doc["injections"]], {int(k): t for k, t in doc["detected"].items()})`` and
``elastrun goodput job/logs`` then give the two sides again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from elastrun.observe.events import read_log_dir
from elastrun.observe.goodput_report import format_breakdown, load
from tests.harness import Cluster, base_env, free_port, listening, wait_until
from tests.observe.browser import open_page, script_errors, why_not
from tests.observe.goodput_truth import Injection, read_truth, truth

pytestmark = pytest.mark.e2e

JOB = Path(__file__).with_name("goodput_job.py")
#: Largest difference allowed per cause, as a share of the job's worker-seconds (the docs state it).
TOLERANCE = 0.02
#: Seconds of steady stepping between faults (every rank stepping again, then this long).
SETTLE = 1.5
_DETECTIONS = ("worker_failure", "hang_detected", "restart", "nodes_waiting")
#: The faults the job has, in order, by elastrun's kinds (the pre-emption: a node that left).
KINDS = ["worker_failure", "join", "hang", "node_lost", "join", "node_lost"]


class Job:
    """The faulted job of one mode, run once per module; its logs, the workers' logs and the injections."""

    def __init__(self, mode: str, tmp: Path) -> None:
        self.tmp = tmp
        self.log_dir = tmp / "logs"
        self.truth_dir = tmp / "truth"
        self.truth_dir.mkdir()
        self.stop = tmp / "stop"
        self.env = base_env(TRUTH_DIR=str(self.truth_dir), STOP_FILE=str(self.stop), MODE=mode,
                            STEP_SECONDS="0.05")
        self.port = free_port()
        self.injections: list[Injection] = []
        self.cluster = Cluster(tmp)
        self._detected: dict[int, float] | None = None

    def flags(self) -> list[str]:
        return ["--nnodes=2:3", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
                "--rdzv-id=goodput-accuracy", "--max-restarts=6", "--hang-timeout=2", f"--log-dir={self.log_dir}"]

    def steps(self) -> list[dict]:
        out = []
        for path in self.truth_dir.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e["ev"] == "step":
                    out.append(e)
        return out

    def stepping(self, world: int, after: float, count: int = 3) -> bool:
        """Every rank of a ``world``-sized group has stepped ``count`` times since ``after``."""
        per_rank: dict[int, int] = {}
        for e in self.steps():
            if e["world"] == world and e["t0"] > after:
                per_rank[e["rank"]] = per_rank.get(e["rank"], 0) + 1
        return len(per_rank) == world and min(per_rank.values()) >= count

    def settle(self, world: int, after: float, what: str) -> None:
        wait_until(lambda: self.stepping(world, after), 90, 0.05, what=f"{what}; {self.cluster.outputs()}")
        time.sleep(SETTLE)

    def worker_of(self, agent, rank: int | None = None) -> int:
        """The stepping worker process under ``agent`` (of ``rank`` if given)."""
        mine = set(agent.descendants())
        latest: dict[int, dict] = {}
        for e in self.steps():
            if e["pid"] in mine and (rank is None or e["rank"] == rank):
                latest[e["pid"]] = e
        assert latest, f"no stepping worker under agent {agent.pid}"
        return max(latest.values(), key=lambda e: e["t2"])["pid"]

    def run(self) -> None:
        a = self.cluster.start(self.flags(), [str(JOB)], env=self.env, name="a")
        wait_until(lambda: listening(self.port), 30, what="node A's store")
        b = self.cluster.start(self.flags(), [str(JOB)], env=self.env, name="b")
        self.settle(2, 0.0, "A and B stepping")
        # 1. a worker crash: rank 1's process is SIGKILLed
        victim = self.worker_of(b)
        self._inject("crash", [victim], lambda: os.kill(victim, signal.SIGKILL))
        self.settle(2, self.injections[-1].t, "recovery from the crash")
        # 2. a join: node C arrives
        launched = time.time()
        c = self.cluster.start(self.flags(), [str(JOB)], env=self.env, name="c")
        self.injections.append(Injection("join", launched))
        self.settle(3, launched, "C joined")
        # 3. a hang: C's worker stops (SIGSTOP); the agent's --hang-timeout finds it
        hung = self.worker_of(c)
        self._inject("hang", [hung], lambda: os.kill(hung, signal.SIGSTOP))
        self.settle(3, self.injections[-1].t, "recovery from the hang")
        # 4. a lost node: B's agent and worker die at once
        doomed = [b.pid, *b.descendants()]
        self._inject("node_loss", [p for p in doomed if p != b.pid], lambda: _kill_all(doomed))
        self.settle(2, self.injections[-1].t, "recovery from the node loss")
        # 5. another join, node D, then D is pre-empted: SIGTERM to its agent (its worker checkpoints and exits)
        launched = time.time()
        d = self.cluster.start(self.flags(), [str(JOB)], env=self.env, name="d")
        self.injections.append(Injection("join", launched))
        self.settle(3, launched, "D joined")
        gone = self.worker_of(d)
        self._inject("preemption", [gone], lambda: os.kill(d.pid, signal.SIGTERM))
        self.settle(2, self.injections[-1].t, "recovery from the pre-emption")
        assert d.wait(60) == 128 + signal.SIGTERM, self.cluster.outputs()
        final = max(e["n"] for e in self.steps()) + 20
        tmp = self.stop.with_suffix(".tmp")
        tmp.write_text(str(final))
        tmp.rename(self.stop)
        assert a.wait(90) == 0, self.cluster.outputs()
        assert c.wait(90) == 0, self.cluster.outputs()

    def keep(self, dest: Path) -> None:
        """Copy the job's files to ``dest`` (GOODPUT_KEEP_DIR), with ``injections.json``."""
        try:
            detected = self.detections()  # first: a join's time becomes its detection
        except AssertionError:  # a fault no agent noticed: keep what there is
            detected = None
        doc = {"injections": [vars(i) for i in self.injections], "detected": detected}
        (self.tmp / "injections.json").write_text(json.dumps(doc))
        shutil.copytree(self.tmp, dest / self.tmp.name, dirs_exist_ok=True)

    def _inject(self, kind: str, pids: list[int], act) -> None:
        t = time.time()
        act()
        self.injections.append(Injection(kind, t, pids))

    def detections(self) -> dict[int, float]:
        """When an agent first knew of each injection (read once).  A join's time becomes that moment, and its
        ``joined`` the moment the new node's first round formed."""
        if self._detected is not None:
            return self._detected
        events = read_log_dir(self.log_dir)
        out = {}
        for i, inj in enumerate(self.injections):
            seen = [float(e["ts"]) for e in events if float(e["ts"]) > inj.t and (
                e["event"] in _DETECTIONS or (e["event"] == "worker_exit" and (e.get("exitcode") or e.get("signal"))))]
            assert seen, f"no agent noticed the {inj.kind}"
            out[i] = min(seen)
            if inj.kind == "join":
                # the joining node: the agent started after the launch; its wait ends when its first round forms
                node = next(e["node"] for e in events if e["event"] == "agent_start" and float(e["ts"]) >= inj.t)
                inj.joined = min(float(e["ts"]) for e in events if e["node"] == node and e["event"] == "round_closed")
                inj.t = out[i]  # a join is no fault in the workers' time line: it costs from its detection
        self._detected = out
        return out


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module", params=["run", "plain"])
def job(request) -> Job:
    tmp = Path(tempfile.mkdtemp(prefix=f"elastrun-goodput-{request.param}-"))
    j = Job(request.param, tmp)
    try:
        j.run()
        yield j
    finally:
        j.cluster.cleanup()
        if os.environ.get("GOODPUT_KEEP_DIR"):
            j.keep(Path(os.environ["GOODPUT_KEEP_DIR"]))
        shutil.rmtree(tmp, ignore_errors=True)


def _compare(job: Job) -> tuple[dict[str, tuple[float, float]], float]:
    gp = load(job.log_dir)
    seen = truth(read_truth(job.truth_dir), job.injections, job.detections())
    pairs = {
        "good": (gp.good, seen["good"]),
        "commit": (gp.badput["commit"], seen["commit"]),
        "redone": (gp.badput["redone"], seen["redone"]),
        "detection": (gp.badput["detection"], seen["detection"]),
        "hang": (gp.badput["hang"], seen["hang"]),
    }
    if "restore" in seen and job.env["MODE"] == "plain":
        pairs["restore"] = (gp.badput["restore"], seen["restore"])
    for i, inj in enumerate(job.injections):
        fault = next((f for f in gp.faults if abs(f.detected - job.detections()[i]) < 1.0), None)
        assert fault is not None, f"no fault found for the {inj.kind} at {inj.t}: {[f.label for f in gp.faults]}"
        pairs[f"{inj.kind} {i + 1} (fault cost)"] = (fault.total, seen[f"fault{i}"])
    return pairs, gp.device_seconds


def faults_seen(job: Job) -> str:
    """The faults computed, then every worker failure the agents logged with its last words: what an
    unexpected fault count needs (a worker that failed on its own, and why)."""
    lines = [f"faults: {[f.label for f in load(job.log_dir).faults]}", "worker failures the agents logged:"]
    for e in read_log_dir(job.log_dir):
        if e["event"] == "worker_failure":
            how = e.get("signal") or f"exit code {e.get('exitcode')}"
            lines.append(f"  {e['ts']:.2f} {e['node']} round {e.get('round')} rank {e.get('rank')} {how}"
                         f" peer_error={e.get('peer_error')}: {str(e.get('message') or '')[-800:]}")
    lines.append("injections: " + ", ".join(f"{i.kind} at {i.t:.2f}" for i in job.injections))
    return "\n".join(lines)


def test_goodput_and_each_cause_match_what_the_workers_saw(job: Job) -> None:
    pairs, total = _compare(job)
    gp = load(job.log_dir)
    assert len(gp.faults) == len(KINDS), faults_seen(job)
    kinds = [f.kind for f in gp.faults]
    assert kinds == KINDS, kinds
    assert gp.faults[-1].label.endswith("left (SIGTERM received)"), gp.faults[-1].label
    report = "\n".join(f"{k:24s} computed {c:8.2f}  workers saw {t:8.2f}  error {100 * abs(c - t) / total:5.2f} %"
                       for k, (c, t) in pairs.items())
    print(f"\n{job.env['MODE']}: {total:.1f} worker-s, goodput {100 * (gp.ratio or 0):.1f} %\n{report}")
    out = os.environ.get("GOODPUT_ACCURACY_OUT")
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps({"mode": job.env["MODE"], "worker_seconds": total,
                                 "errors": {k: abs(c - t) / total for k, (c, t) in pairs.items()},
                                 "pairs": pairs}) + "\n")
    bad = {k: (c, t) for k, (c, t) in pairs.items() if abs(c - t) > TOLERANCE * total}
    assert not bad, (f"off by more than {100 * TOLERANCE:g} % of {total:.1f} worker-s: {bad}\n{report}\n"
                     f"{format_breakdown(gp)}\ninjections: {job.injections}\nevents:\n"
                     + "\n".join(f"{e['ts'] - gp.start:7.2f} {e['node'][-4:]} {e['event']} "
                                 f"{ {k: v for k, v in e.items() if k not in ('ts', 'node', 'event', 'message')} }"
                                 for e in read_log_dir(job.log_dir)))


def test_the_cli_prints_the_breakdown_and_json(job: Job) -> None:
    cmd = [sys.executable, "-m", "elastrun", "goodput", str(job.log_dir)]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=base_env())
    assert text.returncode == 0, text.stderr
    assert "goodput:" in text.stdout and f"fault {len(KINDS)} at" in text.stdout, text.stdout
    doc = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60,
                                    env=base_env()).stdout)
    assert [f["kind"] for f in doc["faults"]] == KINDS, faults_seen(job)
    assert doc["basis"] == "steps"
    assert 0 < doc["goodput_ratio"] < 1
    parts = doc["goodput_seconds"] + sum(doc["badput_seconds"].values())
    assert parts == pytest.approx(doc["worker_seconds"], rel=1e-3)
    wall = doc["wall_goodput_seconds"] + sum(doc["wall_badput_seconds"].values())
    assert wall == pytest.approx(doc["wall_seconds"], rel=1e-3)


def test_the_timeline_page_works_in_a_real_browser(job: Job, tmp_path: Path) -> None:
    """``elastrun timeline --html`` in headless Chromium: no script error, hover shows times, every fault listed."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    page = tmp_path / "timeline.html"
    made = subprocess.run([sys.executable, "-m", "elastrun", "timeline", str(job.log_dir), "-o",
                           str(tmp_path / "timeline.png"), "--html", str(page)], capture_output=True, text=True,
                          timeout=120, env=base_env())
    assert made.returncode == 0, made.stderr
    gp = load(job.log_dir)
    driver = open_page(page, tmp_path / "profile")
    try:
        assert driver.find_element(By.ID, "timeline").is_displayed()
        spans = [s for s in driver.find_elements(By.CSS_SELECTOR, "rect.cause-good") if s.size["width"] > 8]
        assert spans, "no goodput span drawn"
        tip = driver.find_element(By.ID, "tip")
        assert not tip.is_displayed()
        ActionChains(driver).move_to_element(spans[0]).perform()
        assert tip.is_displayed(), "hovering a span shows nothing"
        expected = spans[0].get_attribute("data-tip")
        assert tip.text.split() == expected.split() and " s to " in tip.text and "goodput" in tip.text, tip.text
        rows = driver.find_elements(By.CSS_SELECTOR, "#faults tr.fault")
        assert len(rows) == len(gp.faults) == len(KINDS), faults_seen(job)
        for row, fault in zip(rows, gp.faults, strict=True):
            assert fault.label in row.text and f"{fault.total:.1f}" in row.text, row.text
        assert gp.faults and driver.find_element(By.CSS_SELECTOR, "p.goodput").text.startswith("goodput ")
        assert script_errors(driver) == []
    finally:
        driver.quit()
