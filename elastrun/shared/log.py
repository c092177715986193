"""elastrun's own messages: stdlib :mod:`logging`, with one handler that writes the console lines.

Every part speaks through a child of the ``elastrun`` logger (:func:`get`: ``agent``, ``pool``,
``rendezvous``, ``launcher``, ``observe``, ``cli``), so ``-q``/``-v`` mean the same for all of
them: :func:`configure` sets the level once (``-q``: errors only; default: info; ``-v``: debug).
The handler keeps the console format the agent always had::

    elastrun[<node>] 12:00:00 warning: <message>
        <continuation line>

(``elastrun: warning: <message>`` before this process's agent has a node id), and writes each
record in one write under :data:`CONSOLE_LOCK`, the lock that worker output lines take too, so
that a line never interleaves with another.  An application embedding elastrun may add handlers
of its own to the ``elastrun`` logger.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

ROOT = "elastrun"
#: The console level (``ERROR``, ``INFO`` or ``DEBUG``) the agent hands its workers, for
#: :mod:`elastrun.train`'s warnings.
LEVEL_ENV = "ELASTRUN_LOG_LEVEL"
#: Serialises console writes of this process: elastrun's messages and the workers' output lines.
CONSOLE_LOCK = threading.Lock()

_LEVEL_WORDS = {logging.DEBUG: "debug: ", logging.INFO: "", logging.WARNING: "warning: "}


class ConsoleHandler(logging.Handler):
    """Writes records as elastrun's console lines on stderr (the stream current at each write)."""

    def __init__(self) -> None:
        super().__init__()
        #: This process's node id once its agent has one; the prefix is then ``elastrun[<node>]``.
        self.node: str | None = None

    def format(self, record: logging.LogRecord) -> str:
        lines = record.getMessage().rstrip("\n").split("\n")
        level = _LEVEL_WORDS.get(record.levelno, "error: ")
        if self.node is None:
            head = f"{ROOT}: {level}{lines[0]}"
        else:
            head = f"{ROOT}[{self.node}] {time.strftime('%H:%M:%S', time.localtime(record.created))} {level}{lines[0]}"
        return head + "\n" + "".join(f"    {line}\n" for line in lines[1:])

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # noqa: BLE001 - a bad record must not take the agent down
            self.handleError(record)
            return
        with CONSOLE_LOCK:
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass


_handler = ConsoleHandler()


def get(part: str) -> logging.Logger:
    """The logger of one part of elastrun (``elastrun.<part>``)."""
    return logging.getLogger(f"{ROOT}.{part}")


def configure(quiet: bool = False, verbose: bool = False) -> None:
    """Send elastrun's messages to the console at the level ``-q``/``-v`` ask for; forget any node id."""
    _install()
    logging.getLogger(ROOT).setLevel(logging.ERROR if quiet else logging.DEBUG if verbose else logging.INFO)
    _handler.node = None


def set_node(node_id: str) -> None:
    """From now on prefix lines with ``elastrun[<node_id>]`` and the time (the agent knows its id)."""
    _handler.node = node_id


@contextlib.contextmanager
def kept_settings() -> Iterator[None]:
    """Put the level and node id back as they were on leaving: a library call (``elastrun.launch``)
    configures logging for its job and must not leave the caller's process changed (a ``quiet=True``
    launch silenced every later warning of elastrun in the caller)."""
    root = logging.getLogger(ROOT)
    level, node = root.level, _handler.node
    try:
        yield
    finally:
        root.setLevel(level)
        _handler.node = node


def level_name() -> str:
    """The console level in effect, as :data:`LEVEL_ENV` gives it to workers."""
    return logging.getLevelName(logging.getLogger(ROOT).getEffectiveLevel())


def verbose() -> bool:
    """Whether ``-v`` is in effect (details such as member lists are shown)."""
    return logging.getLogger(ROOT).isEnabledFor(logging.DEBUG)


def _install() -> None:
    """At import: elastrun's messages reach the console (at info) even before :func:`configure`."""
    root = logging.getLogger(ROOT)
    if _handler not in root.handlers:
        root.addHandler(_handler)
    root.propagate = False
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


_install()
