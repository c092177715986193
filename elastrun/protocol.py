"""What an agent and its workers agree on: the only code both sides of a worker's process boundary import.

The agent's side (``elastrun.agent``, ``elastrun.workers``) and the code that runs inside a worker
(``elastrun.inworker``, ``elastrun.train``) never import each other; they meet here:

- how an exec'd worker is entered (:func:`exec_argv`: elastrun's bootstrap runs the user's script);
- the environment variables the agent sets for elastrun's own use (``*_ENV`` below; torchrun's
  contract, ``RANK`` and the rest, is built in :mod:`elastrun.agent.launches`);
- the files a worker leaves for its agent: the heartbeat file and, beside it, the exit report
  (:func:`exit_report_path`);
- the control channel's framing: JSON objects, one per line (:class:`LineReader`, :func:`encode_line`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: A file the worker touches once per unit of progress (``elastrun.heartbeat()``); its exit report lies beside it.
HEARTBEAT_ENV = "ELASTRUN_HEARTBEAT_FILE"
#: The Unix socket of the agent's control server (in-process re-forms, ``elastrun.train.run``).
SOCKET_ENV = "ELASTRUN_CONTROL_SOCKET"
#: Seconds a worker whose group broke on its own (a peer's connection closed) waits for its agent.
WAIT_ENV = "ELASTRUN_REFORM_WAIT"
#: The node-local memory directory of ``elastrun.train``'s snapshots.
SNAPSHOT_DIR_ENV = "ELASTRUN_SNAPSHOT_DIR"

#: The package's parent directory: the exec'd bootstrap imports this very copy of elastrun.
_ROOT = str(Path(__file__).resolve().parents[1])

_EXEC_PROGRAM = (
    "import sys\n"
    "sys.path[0] = {root!r}\n"
    "from elastrun.inworker.bootstrap import exec_main\n"
    "exec_main()\n"
)


def exec_argv(python: str, target: str, module: bool, args: list[str]) -> list[str]:
    """The command line of an exec'd worker that runs ``target`` through elastrun's bootstrap.

    ``python -u -c PROGRAM [-m] TARGET ARGS...``: unbuffered output as torchrun's workers have;
    the program is :func:`elastrun.inworker.bootstrap.exec_main`.
    """
    return [python, "-u", "-c", _EXEC_PROGRAM.format(root=_ROOT), *(["-m"] if module else []), target, *args]


def exit_report_path(heartbeat_path: str) -> str:
    """Where a worker reports its script's exit code, beside its heartbeat file."""
    return heartbeat_path + ".exit"


# ------------------------------------------------------------------------------- control framing
#: The longest line a reader keeps; a longer one is dropped whole.
MAX_LINE = 1 << 20


def encode_line(message: dict[str, Any]) -> bytes:
    """One message as the channel carries it: compact JSON and a newline."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Splits a byte stream into JSON messages."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                out.append(message)
        if len(self._buf) > MAX_LINE:
            self._buf = b""
        return out
