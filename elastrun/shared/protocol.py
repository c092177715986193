"""What an agent and its workers agree on: how a worker is entered, its environment, its files, the control channel.

Runs in: the agent and each worker (:mod:`elastrun.shared`).  The agent's side (``elastrun.agent``,
``elastrun.rendezvous``) and the code that runs inside a worker (``elastrun.worker``,
``elastrun.train``) never import each other; about a worker's life they meet here:

- how an exec'd worker is entered (:func:`exec_argv`: elastrun's bootstrap runs the user's script);
- the environment variables the agent sets for elastrun's own use (``*_ENV`` below; torchrun's
  contract, ``RANK`` and the rest, is built in :mod:`elastrun.agent.launches`);
- the files a worker leaves for its agent: the heartbeat file and, beside it, the exit report
  (:func:`exit_report_path`);
- the control channel of in-process re-forms: its messages, small dataclasses (:data:`TO_AGENT`,
  :data:`TO_WORKER`), one JSON object per line (:func:`encode`, :class:`LineReader`); a message that is
  not one of them, or whose fields are wrong, is refused with a :class:`ProtocolError` that says why.
  docs/train.md, "The re-form protocol", has the sequence and its state diagram.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

#: A file the worker touches once per unit of progress (``elastrun.heartbeat()``); its exit report lies beside it.
HEARTBEAT_ENV = "ELASTRUN_HEARTBEAT_FILE"
#: The Unix socket of the agent's control server (in-process re-forms, ``elastrun.train.run``).
SOCKET_ENV = "ELASTRUN_CONTROL_SOCKET"
#: Seconds a worker whose group broke on its own (a peer's connection closed) waits for its agent.
WAIT_ENV = "ELASTRUN_REFORM_WAIT"
#: The node-local memory directory of ``elastrun.train``'s snapshots.
SNAPSHOT_DIR_ENV = "ELASTRUN_SNAPSHOT_DIR"
#: ``host:port`` of the agent's snapshot server (``elastrun/agent/snapserver.py``), which serves that
#: directory to other nodes and keeps their replicas.
SNAPSHOT_SERVER_ENV = "ELASTRUN_SNAPSHOT_SERVER"
#: With a job token: the file (mode 0600) holding the job's snapshot key, which the server and its
#: clients prove they hold (``elastrun/shared/snapshot_wire.py``).
SNAPSHOT_KEY_ENV = "ELASTRUN_SNAPSHOT_KEY_FILE"

#: The package's parent directory: the exec'd bootstrap imports this very copy of elastrun.
_ROOT = str(Path(__file__).resolve().parents[2])

_EXEC_PROGRAM = (
    "import sys\n"
    "sys.path[0] = {root!r}\n"
    "from elastrun.worker.bootstrap import exec_main\n"
    "exec_main()\n"
)


def exec_argv(python: str, target: str, module: bool, args: list[str]) -> list[str]:
    """The command line of an exec'd worker that runs ``target`` through elastrun's bootstrap.

    ``python -u -c PROGRAM [-m] TARGET ARGS...``: unbuffered output as torchrun's workers have;
    the program is :func:`elastrun.worker.bootstrap.exec_main`.
    """
    return [python, "-u", "-c", _EXEC_PROGRAM.format(root=_ROOT), *(["-m"] if module else []), target, *args]


def exit_report_path(heartbeat_path: str) -> str:
    """Where a worker reports its script's exit code, beside its heartbeat file."""
    return heartbeat_path + ".exit"


# ------------------------------------------------------------------------------- control messages
class ProtocolError(ValueError):
    """A control message that is not one of :data:`TO_AGENT` / :data:`TO_WORKER`, or whose fields are wrong."""


@dataclass(frozen=True)
class Hello:
    """worker → agent, first on a connection: this worker (by PID) opted in to in-process re-forms."""

    kind: ClassVar[str] = "hello"
    pid: int
    local_rank: int | None = None


@dataclass(frozen=True)
class Pause:
    """agent → worker: leave the current process group, then say :class:`Paused`.

    ``within`` 0: leave now, wherever the training thread is (a fault).  ``within`` > 0: the group
    is whole (a node joins), so leave at the end of the next ``commit()`` if that comes within
    ``within`` seconds, else now (:mod:`elastrun.train.commit_pause`).
    """

    kind: ClassVar[str] = "pause"
    within: float = 0.0


@dataclass(frozen=True)
class Paused:
    """worker → agent: it left its group; ``live`` is the committed step its own objects hold (None: torn);
    ``at_commit``: it left at the end of a ``commit()`` (nothing of a step was thrown away)."""

    kind: ClassVar[str] = "paused"
    live: int | None
    pid: int
    at_commit: bool = False


@dataclass(frozen=True)
class Assign:
    """agent → worker: the next round's worker environment (``RANK``, ``WORLD_SIZE``, ...) and its number."""

    kind: ClassVar[str] = "assign"
    env: dict[str, str]
    round: int | None


@dataclass(frozen=True)
class Reformed:
    """worker → agent: it joined the round's group and restored ``step`` from ``source`` in ``took`` s."""

    kind: ClassVar[str] = "reformed"
    round: int | None
    source: str | None
    step: int
    took: float
    after: str = ""


@dataclass(frozen=True)
class Failed:
    """worker → agent: its re-form failed (``error``: the exception); the agent restarts it."""

    kind: ClassVar[str] = "failed"
    error: str


ToAgent = Hello | Paused | Reformed | Failed
ToWorker = Pause | Assign
Message = ToAgent | ToWorker
#: What each side accepts.
TO_AGENT: tuple[type, ...] = (Hello, Paused, Reformed, Failed)
TO_WORKER: tuple[type, ...] = (Pause, Assign)

_CHECKS: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "int | None": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "str | None": lambda v: v is None or isinstance(v, str),
    "dict[str, str]": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                                              for k, x in v.items()),
}


def to_wire(message: Message) -> dict[str, Any]:
    """The JSON object of ``message``: its fields and ``"type"``."""
    return {"type": message.kind, **{f.name: getattr(message, f.name) for f in fields(message)}}


def from_wire(obj: Any, accept: tuple[type, ...]) -> Message:
    """The message of one decoded JSON value; :class:`ProtocolError` saying what is wrong otherwise."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a control message must be a JSON object, got {type(obj).__name__}")
    kinds = {cls.kind: cls for cls in accept}
    cls = kinds.get(obj.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown control message type {obj.get('type')!r}; this side accepts "
                            f"{', '.join(kinds)}")
    values = {k: v for k, v in obj.items() if k != "type"}
    known = {f.name: f for f in fields(cls)}
    extra = sorted(set(values) - set(known))
    if extra:
        raise ProtocolError(f"{cls.kind!r} message with unknown field(s) {', '.join(extra)}")
    for name, f in known.items():
        if name not in values:
            if f.default is MISSING:
                raise ProtocolError(f"{cls.kind!r} message without its field {name!r}")
            continue
        if not _CHECKS[str(f.type)](values[name]):
            raise ProtocolError(f"{cls.kind!r} message: field {name!r} must be {f.type}, got {values[name]!r:.80}")
    return cls(**values)


# ------------------------------------------------------------------------------- control framing
#: The longest line a reader keeps; a longer one is refused.
MAX_LINE = 1 << 20


def encode(message: Message) -> bytes:
    """One message as the channel carries it: compact JSON and a newline."""
    return json.dumps(to_wire(message), separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Splits a byte stream into the messages this side accepts, one per line.

    :meth:`feed` returns, in order, each message, or a :class:`ProtocolError` for a line that is not
    one (the caller refuses it: the channel's peer does not speak this protocol).
    """

    def __init__(self, accept: tuple[type, ...]) -> None:
        self.accept = accept
        self._buf = b""

    def feed(self, data: bytes) -> list[Message | ProtocolError]:
        self._buf += data
        out: list[Message | ProtocolError] = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                obj = json.loads(line)
            except ValueError:
                out.append(ProtocolError(f"a control message that is not JSON: {line[:80]!r}"))
                continue
            try:
                out.append(from_wire(obj, self.accept))
            except ProtocolError as exc:
                out.append(exc)
        if len(self._buf) > MAX_LINE:
            self._buf = b""
            out.append(ProtocolError(f"a control message longer than {MAX_LINE} bytes"))
        return out
