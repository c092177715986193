"""``elastrun status``, ``elastrun timeline`` and ``elastrun goodput``: argument parsing and exit codes.

Runs in: the CLI (``elastrun status`` / ``timeline`` / ``goodput``).

``elastrun.cli`` hands over argv with the subcommand first.  Exit codes: 0 done, 1 the job or
its logs could not be read (one line on stderr saying why), 2 bad command line or a missing
optional dependency (matplotlib: the ``timeline`` extra).  Heavy imports
(torch for the store client, matplotlib for the picture) happen only in the subcommand that
needs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

_TIMELINE_EXTRA = "pip install 'elastrun[timeline]'"
_ENV = {"backend": "PET_RDZV_BACKEND", "endpoint": "PET_RDZV_ENDPOINT", "id": "PET_RDZV_ID", "conf": "PET_RDZV_CONF"}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that ``--help`` into a closed pipe raises (argparse swallows it), so the
    command ends as a Unix tool does (:func:`elastrun.cli.end_on_closed_pipe`) instead of exiting 0."""

    def print_help(self, file=None) -> None:
        (file or sys.stdout).write(self.format_help())


def _status_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="elastrun status",
        description="Show a live job: its round, nodes (address, state, ranks, heartbeat age) and restarts. "
        "Reads the rendezvous as a pure client: it never joins or changes the job.",
        allow_abbrev=False,
    )
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="backend",
                   default=os.environ.get(_ENV["backend"]) or "c10d",
                   help="rendezvous backend of the job (default: c10d; env PET_RDZV_BACKEND)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="endpoint",
                   default=os.environ.get(_ENV["endpoint"]) or "127.0.0.1:29400",
                   help="HOST[:PORT] the job's agents were given (default 127.0.0.1:29400; env PET_RDZV_ENDPOINT)")
    p.add_argument("--rdzv-id", "--rdzv_id", dest="run_id", default=os.environ.get(_ENV["id"]) or None,
                   help="the job's id (--rdzv-id of the launch; env PET_RDZV_ID)")
    p.add_argument("--rdzv-conf", "--rdzv_conf", dest="conf", default=os.environ.get(_ENV["conf"]) or "",
                   help="backend settings K=V,... (as for the launch; most backends need none here)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C (in place on a terminal)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the backend (default 3)")
    p.add_argument("--log-dir", "--log_dir", dest="log_dir", default=os.environ.get("PET_LOG_DIR") or None,
                   help="the job's --log-dir, readable from here: adds its goodput so far (env PET_LOG_DIR)")
    return p


def _timeline_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="elastrun timeline",
        description="Draw a job's history from the events-*.jsonl files under LOG_DIR (the --log-dir of "
        "its agents; copy every node's files into one directory for a multi-host job).",
        allow_abbrev=False,
    )
    p.add_argument("log_dir", metavar="LOG_DIR", help="directory holding events-*.jsonl (searched recursively)")
    p.add_argument("-o", "--output", default="timeline.png",
                   help="image to write: .png (default timeline.png), .svg or .pdf; a name without a suffix gets .png")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained interactive HTML page")
    p.add_argument("--json", metavar="FILE", dest="json_out", help="also write the plotted data as JSON")
    return p


def _goodput_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="elastrun goodput",
        description="Goodput and badput of a job, from the events-*.jsonl and step records under LOG_DIR (the "
        "--log-dir of its agents): the share of worker time spent in committed steps never redone, where the "
        "rest went, and what each fault cost. See docs/observe.md.",
        allow_abbrev=False,
    )
    p.add_argument("log_dir", metavar="LOG_DIR", help="directory holding events-*.jsonl (searched recursively)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--spans", action="store_true", help="with --json: include every classified interval")
    return p


def goodput_main(argv: list[str]) -> int:
    """``elastrun goodput LOG_DIR [--json]``; returns the exit code."""
    args = _goodput_parser().parse_args(argv)
    from elastrun.observe.goodput_report import format_breakdown, load, summary_line, to_json

    try:
        gp = load(args.log_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"elastrun goodput: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(to_json(gp, spans=args.spans), indent=1))
    else:
        print(format_breakdown(gp))
        print()
        print(summary_line(gp))
    return 0


def goodput_so_far(log_dir: str) -> dict:
    """The goodput document of a running job's log directory, or ``{"error": why}``: status must still show."""
    from elastrun.observe.goodput_report import load, to_json

    try:
        return to_json(load(log_dir, now=time.time()))
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}


def status_main(argv: list[str]) -> int:
    """``elastrun status ...``; returns the exit code."""
    args = _status_parser().parse_args(argv)
    if not args.run_id:
        print("elastrun status: error: --rdzv-id is required (the job's id, as given to its agents)",
              file=sys.stderr)
        return 2
    if args.interval <= 0 or args.timeout <= 0:
        print("elastrun status: error: --interval and --timeout must be positive", file=sys.stderr)
        return 2
    from elastrun.observe.status_view import format_status, read_status, watch
    from elastrun.rendezvous import conf as rdzv_conf
    from elastrun.rendezvous.api import (
        RendezvousConfigError,
        RendezvousError,
        RendezvousParameters,
        StatusNotSupportedError,
    )

    try:
        conf = rdzv_conf.split(args.conf)
    except ValueError as exc:
        print(f"elastrun status: error: --rdzv-conf {exc}", file=sys.stderr)
        return 2
    params = RendezvousParameters(
        backend=args.backend, endpoint=args.endpoint, run_id=args.run_id, min_nodes=1, max_nodes=1, config=conf
    )

    def read() -> dict:
        doc = read_status(params, args.timeout)
        if args.log_dir:
            doc["goodput"] = goodput_so_far(args.log_dir)
        return doc

    try:
        if args.watch and not args.json:
            return watch(read, args.interval)
        if args.watch:  # one JSON document per line, for a pipe
            while True:
                print(json.dumps(read(), sort_keys=True), flush=True)
                time.sleep(args.interval)
        doc = read()
    except (RendezvousConfigError, StatusNotSupportedError) as exc:
        print(f"elastrun status: error: {exc}", file=sys.stderr)
        return 2
    except RendezvousError as exc:
        print(f"elastrun status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        from elastrun.observe.status_view import _silence_stdout

        _silence_stdout()
        return 0
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else format_status(doc))
    return 0


#: The image formats ``elastrun timeline -o`` writes (matplotlib's Agg canvas writes each).
_IMAGE_SUFFIXES = (".png", ".svg", ".pdf")


def _image_path(output: str) -> tuple[str | None, str | None]:
    """``(path to write, None)`` for a usable ``-o``, or ``(None, the error line)``: checked before anything is
    read or drawn, so a wrong name costs nothing and writes nothing."""
    suffix = Path(output).suffix.lower()
    if not suffix:
        return output + ".png", None
    if suffix in (".html", ".htm"):
        return None, (f"-o {output}: -o writes the image ({', '.join(_IMAGE_SUFFIXES)}); "
                      f"for the interactive page use --html {output}")
    if suffix not in _IMAGE_SUFFIXES:
        return None, f"-o {output}: cannot draw a {suffix} file; use one of {', '.join(_IMAGE_SUFFIXES)}"
    return output, None


def timeline_main(argv: list[str]) -> int:
    """``elastrun timeline LOG_DIR -o IMAGE [--html FILE] [--json FILE]``; returns the exit code."""
    args = _timeline_parser().parse_args(argv)
    image, error = _image_path(args.output)
    if error is not None:
        print(f"elastrun timeline: error: {error}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("matplotlib") is None:
        print(f"elastrun timeline: error: drawing the timeline needs matplotlib, which is not installed; "
              f"install it with: {_TIMELINE_EXTRA}", file=sys.stderr)
        return 2
    from elastrun.observe.timeline import load_timeline, render_png

    try:
        model = load_timeline(args.log_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"elastrun timeline: {exc}", file=sys.stderr)
        return 1
    try:
        written = [render_png(model, image)]
        if args.html:
            from elastrun.observe.timeline_html import render_html

            written.append(render_html(model, args.html))
        if args.json_out:
            from elastrun.observe.timeline_html import model_json

            with open(args.json_out, "w", encoding="utf-8") as fh:
                fh.write(model_json(model))
            written.append(args.json_out)
    except ImportError as exc:
        print(f"elastrun timeline: matplotlib failed to import ({exc}); reinstall it with: {_TIMELINE_EXTRA}",
              file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"elastrun timeline: cannot write the output: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(str(p) for p in written)} ({len(model.lanes)} node(s), "
          f"{len(model.attempts)} attempt(s), {len(model.rounds)} round(s))")
    return 0


_MAINS = {"status": status_main, "timeline": timeline_main, "goodput": goodput_main}


def main(argv: list[str]) -> int:
    """Entry point used by ``elastrun.cli``: ``argv[0]`` is ``status``, ``timeline`` or ``goodput``."""
    if not argv or argv[0] not in _MAINS:
        print("elastrun: error: expected 'status', 'timeline' or 'goodput'", file=sys.stderr)
        return 2
    try:
        return _MAINS[argv[0]](argv[1:])
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, message already printed)
        return int(exc.code or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
