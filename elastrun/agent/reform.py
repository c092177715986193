"""The agent's side of in-process re-forms: pause the workers that opted in, hand them the next round.

Workers whose script runs ``elastrun.train.run`` connect to the agent's control socket
(:mod:`elastrun.workers.control`).  When the agent would kill its workers for a new round (a
local failure, a hang, a change elsewhere), :meth:`Reformer.pause` instead asks those that are
alive and connected to leave their process group, and waits — at most ``--reform-timeout``
seconds — for each to say it did.  Those that answer are kept: after the next round closes
:meth:`Reformer.assign` sends each its new environment and it joins the new group in the same
process.  Those that do not answer in time are killed and started again, as every worker of a
script that did not opt in is (the fallback: never a hang, never a worker left in an old group).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from elastrun.protocol import SOCKET_ENV, WAIT_ENV, Assign, Failed, Pause, Paused, Reformed
from elastrun.workers.api import WorkerHandle
from elastrun.workers.control import ControlServer

#: How long a worker whose group broke on its own (a peer died) waits for its agent's pause: the
#: agent hears of a dead peer through the rendezvous (a reported failure, a missed heartbeat).
WORKER_WAIT = 30.0
_MAX_SOCKET_PATH = 100


@dataclass
class Pending:
    """A re-form under way: when the change was seen, and which local ranks kept their process."""

    detected_at: float
    paused_in: float
    kept: dict[int, int] = field(default_factory=dict)  # local rank -> pid
    restarted: list[int] = field(default_factory=list)  # local ranks started anew
    reformed: dict[int, Reformed] = field(default_factory=dict)  # local rank -> the worker's report
    round: int | None = None


class Reformer:
    """Pauses, keeps and re-assigns the workers that opted in; everything else is the agent's."""

    def __init__(self, runtime_dir: Path, fallback_dir: Path, timeout: float) -> None:
        self.timeout = timeout
        path = runtime_dir / "control.sock"
        if len(str(path)) > _MAX_SOCKET_PATH:  # a Unix socket path is limited to 108 bytes
            path = fallback_dir / "control.sock"
        self.server: ControlServer | None = ControlServer(path) if timeout > 0 else None
        #: Paused workers kept for the next round, by local rank.
        self.kept: dict[int, WorkerHandle] = {}
        self.pending: Pending | None = None

    def env(self) -> dict[str, str]:
        """What every worker's environment gets (nothing when re-forms are off)."""
        if self.server is None:
            return {}
        return {SOCKET_ENV: str(self.server.path), WAIT_ENV: f"{WORKER_WAIT:g}"}

    def filenos(self) -> list[int]:
        return self.server.filenos() if self.server is not None else []

    def pump(self) -> None:
        if self.server is not None:
            self.server.pump(0.0)

    def opted_in(self, handle: WorkerHandle) -> bool:
        return self.server is not None and handle.poll() is None and self.server.connected(handle.pid)

    def pause(self, handles: list[WorkerHandle], detected_at: float) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
        """Ask the live, opted-in ``handles`` to leave their group: ``(kept, asked)``, kept being
        those that said they did within the bound."""
        if self.server is None:
            return [], []
        self.pump()
        asked = [h for h in handles if self.opted_in(h) and self.server.send(h.pid, Pause())]
        if not asked:
            return [], []
        t0 = time.monotonic()
        answers = self.server.wait_for([h.pid for h in asked], (Paused, Failed), self.timeout)
        kept = [h for h in asked if isinstance(answers.get(h.pid), Paused) and h.poll() is None]
        self.kept = {h.launch.local_rank: h for h in kept}
        self.pending = Pending(detected_at=detected_at, paused_in=time.monotonic() - t0)
        return kept, asked

    def forget(self, handle: WorkerHandle) -> None:
        if self.server is not None:
            self.server.forget(handle.pid)

    def assign(self, handle: WorkerHandle, env: dict[str, str], round_: int) -> bool:
        """Send a kept worker its new environment; False if it is gone."""
        if self.server is None or handle.poll() is not None:
            return False
        return self.server.send(handle.pid, Assign(env=env, round=round_))

    def take(self, handle: WorkerHandle, kind: type[Reformed] | type[Failed]) -> Reformed | Failed | None:
        return self.server.take(handle.pid, kind) if self.server is not None else None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
