"""Third-party scripts (tests/clients/scripts/) under torchrun and under elastrun, each through its fault.

For each client and each launcher, in the same run: start it, wait until it trains, inject the fault
its test injects (SIGKILL of rank 1's worker; for the TorchElastic-style script a second node joining,
then that node's agent and workers SIGKILLed), and record the exit code and whether the job came
through (it resumed from its own checkpoint and reached its last epoch), and the job's goodput: the share
of its worker-seconds (launch to exit) spent in training steps that were kept, from the steps the script
itself timed (tests/clients/scripts/step_times.py; bench/goodput_steps.py), so both launchers are
measured alike.  Output: a markdown table on stdout, the raw results as JSON with ``--json``.

    python bench/bench_clients.py [--only accelerate,ddp_tutorial,lightning,torchelastic] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import LAUNCHERS, PYTHON, ROOT, free_port, kill_tree, log  # noqa: E402
from bench.goodput_steps import StepTime, measure  # noqa: E402

SCRIPTS = ROOT / "tests" / "clients" / "scripts"


@dataclass
class Result:
    client: str
    launcher: str
    fault: str
    exit_code: int | None
    survived: bool
    seconds: float
    note: str = ""
    #: The end of the launcher's output when the job did not come through (for the log, not the table).
    tail: str = ""
    #: Goodput in % of the job's worker-seconds, from the script's own step times (None: not measured).
    goodput: float | None = None


class Run:
    """One launcher process (one node) with its output in a file."""

    def __init__(self, which: str, flags: list[str], script: list[str], workdir: Path, tag: str,
                 workers: int = 1) -> None:
        self.which, self.workdir, self.workers = which, workdir, workers
        self.steps = workdir / "steps"
        self.steps.mkdir(exist_ok=True)
        self.log_dir = workdir / f"events-{tag}"
        self.out = workdir / f"{tag}.out"
        if which == "torchrun":
            argv = [PYTHON, "-m", "torch.distributed.run", *flags, *script]
        else:
            argv = [PYTHON, "-m", "elastrun", f"--log-dir={self.log_dir}", *flags, *script]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
               "STEP_TIMES_DIR": str(self.steps)}
        self.started = time.time()
        self.ended: float | None = None
        with open(self.out, "wb") as fh:
            self.proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def wait_output(self, pattern: str, timeout: float) -> re.Match[str] | None:
        """The first match in the output; None when ``timeout`` passed or the launcher exited first."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = regex.search(self.output())
            if m or self.proc.poll() is not None:
                return m
            time.sleep(0.05)
        return None

    def worker_of_rank(self, rank: int) -> int | None:
        """PID of the newest worker of ``rank``: elastrun's events; torchrun's children's environment."""
        if self.which == "elastrun":
            from elastrun.observe.events import read_log_dir

            starts = [e for e in read_log_dir(self.log_dir) if e["event"] == "worker_start" and e["rank"] == rank]
            return int(starts[-1]["pid"]) if starts else None
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child.pid
            except psutil.Error:
                continue
        return None

    def wait(self, timeout: float) -> int | None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.ended = self.ended or time.time()
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait(10)
        self.ended = self.ended or time.time()


def goodput(runs: list[Run]) -> float | None:
    """Goodput (%) of the nodes ``runs``, from the steps their scripts timed: kept step time over worker-seconds."""
    steps = []
    for path in runs[0].steps.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            steps.append(StepTime((e["e"], e["i"]), e["t0"], e["t1"]))
    if not steps or any(r.ended is None for r in runs):
        return None
    start = min(r.started for r in runs)
    end = max(r.ended or 0.0 for r in runs)
    worker_seconds = sum(r.workers * ((r.ended or 0.0) - r.started) for r in runs)  # nodes come and go
    return 100 * measure(steps, 1, start, end).kept_seconds / max(worker_seconds, 1e-9)


def kill_rank(run: Run, rank: int) -> bool:
    pid = run.worker_of_rank(rank)
    if pid is None:
        return False
    os.kill(pid, signal.SIGKILL)
    return True


#: client → (script and arguments, when to strike, what resuming looks like, what the end looks like)
SINGLE_NODE = {
    "accelerate": (["accelerate_train.py", "--epochs", "6", "--output-dir", "out", "--step-seconds", "0.05"],
                   r"epoch 1 accuracy", r"resumed from \S+ at epoch [1-5]", r"done: 6 epochs"),
    "ddp_tutorial": (["ddp_tutorial.py", "6", "1", "--snapshot-path", "snapshot.pt", "--step-seconds", "0.05"],
                     r"Epoch 1 \| Training snapshot saved", r"Resuming training from snapshot at Epoch [2-5]",
                     r"\[RANK0\] done"),
    "lightning": (["lightning_train.py", "--epochs", "5", "--checkpoint-dir", "ckpt", "--step-seconds", "0.05"],
                  r"epoch 1 done", r"global_rank 0 world_size 2 epoch [1-4]", r"done: 5 epochs, world_size 2"),
}


def single_node(client: str, which: str, workdir: Path) -> Result:
    script, strike, resumed, done = SINGLE_NODE[client]
    started = time.monotonic()
    run = Run(which, ["--standalone", "--nproc-per-node=2", "--max-restarts=1"],
              [str(SCRIPTS / script[0]), *script[1:]], workdir, "node", workers=2)
    try:
        if run.wait_output(strike, 300) is None:
            return Result(client, which, "worker SIGKILL", run.proc.poll(), False, time.monotonic() - started,
                          "never reached the point of the fault")
        killed = kill_rank(run, 1)
        code = run.wait(300)
        out = run.output()
        ok = code == 0 and killed and bool(re.search(resumed, out)) and bool(re.search(done, out))
        note = "" if ok else ("no worker of rank 1 found" if not killed else
                              "timed out" if code is None else "did not resume and finish")
        return Result(client, which, "worker SIGKILL", code, ok, time.monotonic() - started, note,
                      "" if ok else out[-2500:], goodput([run]) if ok else None)
    finally:
        run.close()


def join_and_loss(which: str, workdir: Path) -> Result:
    """Node B joins node A's ``--nnodes=1:2`` job, receives the checkpoint, then is lost."""
    port = free_port()
    flags = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=bench-clients", "--max-restarts=3"]
    script = [str(SCRIPTS / "torchelastic_imagenet.py"), "--epochs", "12", "--step-seconds", "0.03"]
    fault = "node join, then node loss"
    started = time.monotonic()
    a = Run(which, flags, [*script, "--checkpoint-file", str(workdir / "a" / "ckpt.pt")], workdir, "a")
    b = None
    try:
        if a.wait_output(r"saved checkpoint for epoch 0", 300) is None:
            return Result("torchelastic", which, fault, a.proc.poll(), False, time.monotonic() - started,
                          "node A never trained")
        b = Run(which, flags, [*script, "--checkpoint-file", str(workdir / "b" / "ckpt.pt")], workdir, "b")
        received = b.wait_output(r"received checkpoint of epoch \d+", 180)
        stepped = received and b.wait_output(r"epoch \d+ world 2", 120)
        if not stepped:
            code = a.wait(120)
            return Result("torchelastic", which, fault, code, False, time.monotonic() - started,
                          f"the join failed (A exit {code}, B exit {b.proc.poll()})",
                          f"--- A ---\n{a.output()[-2000:]}\n--- B ---\n{b.output()[-2000:]}")
        kill_tree(b.proc.pid)  # the node is gone: its agent and its workers
        b.proc.wait(10)
        b.ended = time.time()
        lost_at = len(a.output())
        code = a.wait(300)
        rest = a.output()[lost_at:]
        ok = code == 0 and "world 1" in rest and "done: epoch 11" in rest
        note = "" if ok else ("timed out after the loss" if code is None else "did not finish after the loss")
        return Result("torchelastic", which, fault, code, ok, time.monotonic() - started, note,
                      "" if ok else rest[-2500:], goodput([a, b]) if ok else None)
    finally:
        a.close()
        if b is not None:
            b.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="accelerate,ddp_tutorial,lightning,torchelastic")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    results = []
    for client in args.only.split(","):
        for which in LAUNCHERS:
            workdir = Path(subprocess.check_output(["mktemp", "-d", f"/tmp/elastrun-clients-{client}-XXXX"],
                                                   text=True).strip())
            log(f"{client} under {which}")
            try:
                r = join_and_loss(which, workdir) if client == "torchelastic" else single_node(client, which, workdir)
            finally:
                subprocess.run(["rm", "-rf", str(workdir)], check=False)
            log(f"  exit {r.exit_code}, survived {r.survived}, {r.seconds:.1f} s, goodput {r.goodput} {r.note}")
            if r.tail:
                log(f"  output:\n{r.tail}")
            results.append(r)
    print("| client | fault | torchrun: exit, came through | elastrun: exit, came through | goodput: torchrun, "
          "elastrun |")
    print("|---|---|---|---|---|")
    for client in dict.fromkeys(r.client for r in results):
        row = {r.launcher: r for r in results if r.client == client}
        cells = [f"{'none (still running)' if row[w].exit_code is None else row[w].exit_code}, "
                 f"{'yes' if row[w].survived else 'no'}"
                 + (f" ({row[w].note})" if row[w].note else "") + f", {row[w].seconds:.0f} s" for w in LAUNCHERS]
        good = ", ".join("—" if row[w].goodput is None else f"{row[w].goodput:.1f} %" for w in LAUNCHERS)
        print(f"| {client} | {row[LAUNCHERS[0]].fault} | {cells[0]} | {cells[1]} | {good} |")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
