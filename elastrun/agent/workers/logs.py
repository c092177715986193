"""Worker output: per-rank log files, console prefixes, tee, rank filtering and a stderr tail.

A worker's stdout/stderr go into a pipe that a :class:`StreamPump` thread reads.  The pump
writes complete lines to the console with a ``[node rank]`` prefix (so lines of different ranks
never interleave mid-line), to the rank's log file when redirected, and keeps the last lines of
stderr in memory for the failure summary when the worker wrote no error file.

A dying worker's traceback is *held* from the console until its agent has judged the death
(docs/failures.md): a worker that failed only because a peer died gets one line instead, while
its own failure is printed in full.  The pump holds a traceback only when the worker's error file
exists as it starts (the bootstrap writes it before it prints an uncaught exception: the script is
ending), and at most :data:`HOLD_LIMIT` seconds while the stream stays open; the log file and the
tail get every line at once.  Healthy output is never held.
"""

from __future__ import annotations

import collections
import os
import re
import select
import threading
import time
from pathlib import Path
from typing import BinaryIO

TAIL_LINES = 40
#: Longest a traceback is held from the console while its worker's stream is still open (then it is
#: printed: a judgement that did not come must not hide it); after the stream's end it waits for the agent.
HOLD_LIMIT = 5.0
#: Longest held text (a traceback that goes on is not a dying worker's last words): then it is printed.
HOLD_BYTES = 256 * 1024
#: The first line of a Python traceback, with the ``[rank<n>]:`` prefix torch's excepthook adds.
_TRACEBACK = re.compile(rb"^(\[rank\d+\]:\s?)?Traceback \(most recent call last\):")


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
        hold_when: Path | None = None,
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
        #: The worker's error file: a traceback that starts once it exists is held (module docstring).
        self._hold_when = hold_when
        #: Console text held back (prefixed lines), or None; guarded by ``_state``, written under ``_lock``.
        self._held: list[bytes] | None = None
        self._held_since = 0.0
        self._dropped = False
        #: The agent has judged this worker (released): a traceback held after that is printed at the end.
        self._released = False
        self._state = threading.Lock()

    def set_prefix(self, prefix: str) -> None:
        """Prefix later console lines with ``prefix`` (a worker kept across a re-form has a new rank)."""
        self._prefix = prefix.encode()

    @property
    def holding(self) -> bool:
        """Whether console lines are held back now (a dying worker's traceback, awaiting the agent)."""
        return self._held is not None

    def release(self) -> None:
        """Print the held lines now (the worker's own failure, or no judgement); later lines pass."""
        with self._state:
            held, self._held, self._released = self._held, None, True
            if held:
                self._write(b"".join(held))

    def drop(self) -> None:
        """Leave the held lines and the rest of this ended worker's console output out (they are in its
        log and error files): its agent says in one line what it was a consequence of."""
        with self._state:
            self._held, self._dropped = None, True

    def run(self) -> None:
        pending = b""
        try:
            while True:
                timeout = None
                if self._held is not None:
                    timeout = max(0.0, self._held_since + HOLD_LIMIT - time.monotonic())
                    if timeout == 0.0 or not select.select([self._fd], [], [], timeout)[0]:
                        self.release()  # held long enough while the worker still writes: not its end
                        continue
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
            if self._released:
                self.release()  # held after the agent's judgement (output of the worker's children): shown
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
        if self._console is None:
            return
        with self._state:
            if self._dropped:
                return
            start = len(lines)
            if self._held is None and self._hold_when is not None:
                start = next((i for i, line in enumerate(lines) if _TRACEBACK.match(line)), start)
                if start < len(lines) and not self._hold_when.exists():
                    start = len(lines)  # a traceback the script printed itself and lives on: not held
            if self._held is None and start == len(lines):
                self._write(b"".join(self._prefix + line + b"\n" for line in lines))
                return
            if self._held is None:
                self._write(b"".join(self._prefix + line + b"\n" for line in lines[:start]))
                self._held, self._held_since = [], time.monotonic()
            self._held.extend(self._prefix + line + b"\n" for line in lines[start:])
            if sum(map(len, self._held)) > HOLD_BYTES:
                held, self._held = self._held, None
                self._write(b"".join(held))

    def _write(self, text: bytes) -> None:
        if not text or self._console is None:
            return
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
