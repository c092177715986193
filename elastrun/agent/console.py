"""The agent's own console output: short lines on stderr, prefixed so they stand out from workers'.

Training output belongs to the workers; the agent says one line per round, per failure and per
recovery.  ``--quiet`` keeps only errors; ``--verbose`` adds details (member lists, tracebacks).
"""

from __future__ import annotations

import sys
import threading
import time

from elastrun.workers.spawn import CONSOLE_LOCK


class Console:
    """Writes ``elastrun[<node>] <time> <message>`` lines to stderr."""

    def __init__(self, node_id: str, quiet: bool = False, verbose: bool = False) -> None:
        self.prefix = f"elastrun[{node_id}]"
        self.quiet = quiet
        self.verbose = verbose
        self._lock: threading.Lock = CONSOLE_LOCK

    def _write(self, level: str, message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        lines = message.rstrip("\n").split("\n")
        text = f"{self.prefix} {stamp} {level}{lines[0]}\n" + "".join(f"    {line}\n" for line in lines[1:])
        with self._lock:
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def info(self, message: str, detail: str | None = None) -> None:
        if not self.quiet:
            self._write("", message if not (detail and self.verbose) else f"{message}\n{detail}")

    def warn(self, message: str) -> None:
        if not self.quiet:
            self._write("warning: ", message)

    def error(self, message: str) -> None:
        self._write("error: ", message)

    def debug(self, message: str) -> None:
        if self.verbose:
            self._write("debug: ", message)
