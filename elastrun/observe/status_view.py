"""``elastrun status``: read a job's status through its rendezvous backend, and format it.

Runs in: the CLI (``elastrun status``).

Each backend reads its own store (``RendezvousBackend.read_status``: c10d and static in
:mod:`elastrun.rendezvous.c10d.status`, etcd in :mod:`elastrun.rendezvous.etcd.status`) as a
pure client that must not host, join or write, and returns the document described in
docs/observe.md, or raises a ``RendezvousError`` subclass whose message is one line
(``RendezvousConnectionError`` when the backend cannot be reached, ``JobNotFoundError`` when it
has no such job, ``StatusNotSupportedError`` when it has no reader).  This module only formats.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from elastrun.rendezvous import registry
from elastrun.rendezvous.api import RendezvousConfigError, RendezvousError, RendezvousParameters


def read_status(params: RendezvousParameters, timeout: float = 3.0) -> dict[str, Any]:
    """Read the job's status with its backend's reader (errors are ``RendezvousError`` subclasses)."""
    try:
        return registry.read_status(params, timeout)
    except RendezvousError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise RendezvousConfigError(f"cannot read the job's status: {exc}") from None


# ------------------------------------------------------------------------------ formatting
def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _ranks(node: dict[str, Any]) -> str:
    first, last = node.get("ranks") or [None, None]
    if first is None:
        return "-"
    return str(first) if first == last else f"{first}-{last}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]


def format_status(doc: dict[str, Any]) -> str:
    """The human-readable form of a status document (what ``elastrun status`` prints)."""
    lines = []
    head = f"job {doc['run_id']} ({doc['backend']} at {doc['endpoint']}): {doc['state']}"
    if doc.get("round") is not None:
        head += f", round {doc['round']} (generation {doc['generation']}), world size {doc['world_size']}"
        if doc.get("closed_at"):
            head += f", formed {_age(max(0.0, doc['read_at'] - doc['closed_at']))}"
    lines.append(head)
    if doc.get("max_restarts") is not None:
        lines.append(
            f"restarts: {doc['restarts_used']} used, {doc['restarts_left']} left "
            f"(--max-restarts={doc['max_restarts']})"
        )
    if doc.get("nodes"):
        rows = [
            [
                n["node_id"], n.get("hostname") or "-", n.get("addr") or "-", str(n["group_rank"]),
                _ranks(n), n["state"], _age(n.get("heartbeat_age")),
            ]
            for n in doc["nodes"]
        ]
        lines += _table(["NODE", "HOST", "ADDRESS", "GROUP", "RANKS", "STATE", "HEARTBEAT"], rows)
    else:
        lines.append("no round has formed yet")
    if doc.get("waiting"):
        names = ", ".join(f"{w['node_id']} ({w.get('addr') or '?'})" for w in doc["waiting"])
        lines.append(f"joining round {doc['open_round']}: {len(doc['waiting'])} node(s): {names}")
    if doc.get("aborted"):
        lines.append("job failed: " + str(doc["aborted"]).strip().splitlines()[0])
    goodput = doc.get("goodput")
    if goodput:
        lines.append(goodput["summary"] if "summary" in goodput
                     else f"goodput: not available ({goodput.get('error')})")
    return "\n".join(lines)


def watch(read: Callable[[], dict[str, Any]], interval: float, out: Any = None,
          count: int | None = None) -> int:
    """Print the status every ``interval`` s, in place on a terminal; stops on Ctrl-C or a read error.

    ``count`` bounds the refreshes (None: until interrupted).  Returns the exit code.
    """
    out = out or sys.stdout
    tty = out.isatty()
    shown = 0
    if tty:
        out.write("\x1b[2J")  # clear once; each frame then redraws from the top
    try:
        while count is None or shown < count:
            try:
                text = format_status(read())
            except RendezvousError as exc:
                print(f"elastrun status: {exc}", file=sys.stderr)
                return 1
            stamp = time.strftime("%H:%M:%S")
            if tty:  # home, draw, clear what an older, longer frame left below
                out.write(f"\x1b[H{text}\n\n(refreshed {stamp} every {interval:g} s; Ctrl-C to stop)\x1b[J\n")
            else:
                out.write(f"--- {stamp}\n{text}\n")
            out.flush()
            shown += 1
            if count is None or shown < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `elastrun status --watch | head`
        _silence_stdout()
    return 0


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush stays quiet."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError:
        pass
