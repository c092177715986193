"""Run every benchmark, torchrun beside elastrun, and write the results to docs/benchmarks.md.

Usage::

    python bench/run_all.py               # 3 repeats of everything (about 20 minutes on 2 cores)
    python bench/run_all.py --repeat 5 --only launch,recovery,rendezvous --out /tmp/b.md

Each figure is the median of the repeats; the ratio is elastrun / torchrun (below 1: faster).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_launch, bench_recovery, bench_rendezvous  # noqa: E402
from bench.common import ROOT, Row, log  # noqa: E402

SUITES = {"launch": bench_launch, "recovery": bench_recovery, "rendezvous": bench_rendezvous}
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def machine() -> str:
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}; "
            f"load average at the end {load}")


def render(rows: list[Row], notes: list[str], repeat: int, seconds: float) -> str:
    lines = [
        BEGIN,
        f"Run on {datetime.date.today().isoformat()} with `python bench/run_all.py --repeat {repeat}` "
        f"({seconds / 60:.1f} min). Machine: {machine()}.",
        "",
        "| what | torchrun | elastrun | ratio | goal | runs ok (torchrun, elastrun) |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    lines.append("")
    lines += [f"- {note}" for note in notes]
    lines.append(END)
    return "\n".join(lines)


def write(doc: Path, block: str) -> None:
    text = doc.read_text() if doc.exists() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = (text or "# Benchmarks\n\n") + "\n" + block + "\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement (default 3)")
    parser.add_argument("--only", default=",".join(SUITES), help="comma-separated suites: " + ", ".join(SUITES))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md",
                        help="document to write the results into (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    started = time.monotonic()
    rows: list[Row] = []
    notes: list[str] = []
    for name in chosen:
        log(f"suite {name}")
        suite_rows, suite_notes = SUITES[name].run(args.repeat)
        rows += suite_rows
        notes += suite_notes
    block = render(rows, notes, args.repeat, time.monotonic() - started)
    write(args.out, block)
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
