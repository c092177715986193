"""How often a job whose scripts all finished still fails or hangs in the processes' exit.

Runs ``tests/scripts/ddp_del_model.py`` (a DDP script that frees its model right after its last
all-reduce: the shapes that expose torch's process-group teardown race; runs alternate between
``SHAPE=del`` and ``SHAPE=destroy``, the DDP tutorial's ending) many times under
elastrun with default flags (warm pool), elastrun ``--start-method spawn`` and torchrun,
interleaved so that the machine's drift hits all three alike.  A run is a *teardown failure*
when every rank printed its result but the launcher did not exit 0 within the time limit.

Usage::

    python bench/bench_teardown.py --runs 200 --nproc 2          # prints a table
    python bench/bench_teardown.py --runs 200 --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PYTHON, ROOT, kill_tree, log  # noqa: E402

SCRIPT = str(ROOT / "tests" / "scripts" / "ddp_del_model.py")
SETUPS = {
    "elastrun (default)": [PYTHON, "-m", "elastrun"],
    "elastrun --start-method spawn": [PYTHON, "-m", "elastrun", "--start-method=spawn"],
    "torchrun": [PYTHON, "-m", "torch.distributed.run"],
}
BEGIN, END = "<!-- teardown:begin -->", "<!-- teardown:end -->"


def one_run(argv: list[str], nproc: int, limit: float, shape: str) -> tuple[str, float]:
    """Run the script once; ``("ok"|"failed"|"hung"|"broken", seconds)``.

    ``failed``/``hung``: every rank finished its work but the launcher exited non-zero / did not
    exit within ``limit``; ``broken``: a rank never reached its last line (not a teardown fault).
    """
    start = time.monotonic()
    proc = subprocess.Popen([*argv, "--standalone", f"--nproc-per-node={nproc}", SCRIPT],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "SHAPE": shape})
    try:
        out, _ = proc.communicate(timeout=limit)
        hung = False
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        hung = True
    took = time.monotonic() - start
    text = out.decode(errors="replace")
    done = len(set(re.findall(r"done (\d+) ", text)))
    if done < nproc:
        return "broken", took
    if hung:
        return "hung", took
    if proc.returncode != 0:
        return "failed", took
    return ("recovered" if "interpreter teardown" in text else "ok"), took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--limit", type=float, default=90.0, help="seconds before a run counts as hung")
    parser.add_argument("--only", default="", help="comma-separated setup names (prefixes) to run")
    parser.add_argument("--write", help="replace the teardown block of this markdown file")
    args = parser.parse_args(argv)
    setups = {k: v for k, v in SETUPS.items()
              if not args.only or any(k.startswith(p) for p in args.only.split(","))}
    counts = {name: Counter() for name in setups}
    times: dict[str, list[float]] = {name: [] for name in setups}
    began = time.monotonic()
    for i in range(args.runs):
        for name, launcher in setups.items():
            outcome, took = one_run(launcher, args.nproc, args.limit, ("del", "destroy")[i % 2])
            counts[name][outcome] += 1
            times[name].append(took)
            if outcome != "ok":
                log(f"run {i} ({('del', 'destroy')[i % 2]}): {name}: {outcome} ({took:.1f} s)")
        if (i + 1) % 10 == 0:
            log(f"{i + 1}/{args.runs}: " + "; ".join(f"{n}: {dict(c)}" for n, c in counts.items()))
    minutes = (time.monotonic() - began) / 60
    table = render(counts, times, args, minutes)
    print(table)
    if args.write:
        path = Path(args.write)
        text = path.read_text()
        if BEGIN in text:
            text = text[: text.index(BEGIN)] + table + text[text.index(END) + len(END):]
        else:
            text += "\n" + table + "\n"
        path.write_text(text)
    return 0


def render(counts: dict[str, Counter], times: dict[str, list[float]], args: argparse.Namespace,
           minutes: float) -> str:
    lines = [
        BEGIN,
        f"`python bench/bench_teardown.py --runs {args.runs} --nproc {args.nproc}` "
        f"({minutes:.0f} min, {time.strftime('%Y-%m-%d')}): each run is one job of {args.nproc} workers "
        "running `tests/scripts/ddp_del_model.py`, alternately with `SHAPE=del` and `SHAPE=destroy`.",
        "",
        "| launcher | runs | exit 0 | teardown failures (exit ≠ 0 / hung) | of them recovered by elastrun "
        "(warned, exit 0) | median run |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in counts.items():
        runs = sum(c.values())
        ok = c["ok"] + c["recovered"]
        med = sorted(times[name])[len(times[name]) // 2] if times[name] else 0.0
        broken = f" ({c['broken']} never finished their work)" if c["broken"] else ""
        lines.append(f"| {name} | {runs} | {ok} | {c['failed'] + c['hung']} ({c['failed']} / {c['hung']}){broken} "
                     f"| {c['recovered']} | {med:.1f} s |")
    lines.append(END)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
