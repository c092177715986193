"""Worker output: per-rank log files, console prefixes, tee, rank filtering and a stderr tail.

A worker's stdout/stderr go into a pipe that a :class:`StreamPump` thread reads.  The pump
writes complete lines to the console with a ``[node rank]`` prefix (so lines of different ranks
never interleave mid-line), to the rank's log file when redirected, and keeps the last lines of
stderr in memory for the failure summary when the worker wrote no error file.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import BinaryIO

TAIL_LINES = 40


class StreamPump(threading.Thread):
    """Copies one worker stream from a pipe to the console and/or a file, line by line."""

    def __init__(
        self,
        read_fd: int,
        console: BinaryIO | None,
        console_lock: threading.Lock,
        prefix: str,
        file_path: Path | None,
        keep_tail: bool,
    ) -> None:
        super().__init__(daemon=True, name=f"pump{read_fd}")
        self._fd = read_fd
        self._console = console
        self._lock = console_lock
        self._prefix = prefix.encode()
        self._file: BinaryIO | None = None
        if file_path is not None:
            file_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(file_path, "ab")  # noqa: SIM115 - closed by run()
        self.tail: collections.deque[str] | None = collections.deque(maxlen=TAIL_LINES) if keep_tail else None

    def set_prefix(self, prefix: str) -> None:
        """Prefix later console lines with ``prefix`` (a worker kept across a re-form has a new rank)."""
        self._prefix = prefix.encode()

    def run(self) -> None:
        pending = b""
        try:
            while True:
                try:
                    chunk = os.read(self._fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                data = pending + chunk
                lines = data.split(b"\n")
                pending = lines.pop()
                if lines:
                    self._emit(lines)
            if pending:
                self._emit([pending])
        finally:
            os.close(self._fd)
            if self._file is not None:
                self._file.close()

    def _emit(self, lines: list[bytes]) -> None:
        if self._file is not None:
            self._file.write(b"\n".join(lines) + b"\n")
            self._file.flush()
        if self.tail is not None:
            self.tail.extend(line.decode(errors="replace") for line in lines)
        if self._console is not None:
            text = b"".join(self._prefix + line + b"\n" for line in lines)
            with self._lock:
                try:
                    self._console.write(text)
                    self._console.flush()
                except (OSError, ValueError):
                    self._console = None


def tail_text(pump: StreamPump | None, path: Path | None, lines: int = 20) -> str:
    """The last ``lines`` lines a worker wrote to stderr (from memory, else from its log file)."""
    if pump is not None and pump.tail:
        return "\n".join(list(pump.tail)[-lines:])
    if path is not None and path.exists():
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            data = fh.read().decode(errors="replace")
        return "\n".join(data.splitlines()[-lines:])
    return ""
