"""Stand-ins for the agent's neighbours, for unit tests of one of its rooms: worker processes that a
test ends by hand, a starter that makes them, and a control channel whose workers answer as told.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from elastrun.agent.workers.control_server import ControlChannel
from elastrun.agent.workers.starter import ExitStatus, WorkerHandle, WorkerLaunch, WorkerStarter
from elastrun.rendezvous.api import Member, RoundResult
from elastrun.shared.protocol import Pause, ToAgent, ToWorker


class StandInHandle(WorkerHandle):
    """A worker with no process: it ends when the test calls :meth:`exit`, or on SIGKILL."""

    start_method = "stand-in"

    def __init__(self, launch: WorkerLaunch, pid: int) -> None:
        self.launch = launch
        self.pid = pid
        self.signals: list[int] = []
        self.prefix = launch.console_prefix
        self._status: ExitStatus | None = None
        self._r, self._w = os.pipe()
        self.closed = False
        #: What :meth:`frozen` answers (a test sets it: the worker is "stopped").
        self.is_frozen = False
        #: What :meth:`dying` answers (a test sets it: a SIGKILL pending, not yet reaped).
        self.is_dying = False
        #: What :meth:`killed` answers, and whether a SIGKILL leaves it unreaped until the test ends it.
        self.is_killed = False
        self.outlives_kill = False
        #: How many times its exit was hastened (:meth:`hasten`).
        self.hastened = 0
        #: How many times its stacks were asked for (:meth:`dump_stacks`).
        self.dumps = 0
        #: How many times its connections were cut (:meth:`cut_off`).
        self.cuts = 0

    def exit(self, code: int | None = 0, sig: int | None = None) -> None:
        if self._status is None:
            self._status = ExitStatus(exitcode=None if sig else code, signal=sig, timestamp=time.time())
            os.write(self._w, b"x")

    def poll(self) -> ExitStatus | None:
        return self._status

    def fileno(self) -> int:
        return self._r

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL and not self.outlives_kill:
            self.exit(sig=signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> ExitStatus | None:
        return self._status

    def frozen(self) -> bool:
        return self.is_frozen

    def cut_off(self) -> int:
        self.cuts += 1
        return 1

    def dying(self) -> bool:
        return self.is_dying

    def killed(self) -> bool:
        return self.is_killed

    def hasten(self) -> int:
        self.hastened += 1
        return 0

    def dump_stacks(self) -> bool:
        self.dumps += 1
        return self._status is None

    def set_console_prefix(self, prefix: str) -> None:
        self.prefix = prefix

    def close(self) -> None:
        if not self.closed:
            os.close(self._r)
            os.close(self._w)
            self.closed = True


class StandInStarter(WorkerStarter):
    """Makes :class:`StandInHandle` workers, PIDs from 1000 up, and remembers them."""

    name = "stand-in"

    def __init__(self) -> None:
        self.started: list[StandInHandle] = []

    def start(self, launch: WorkerLaunch) -> StandInHandle:
        handle = StandInHandle(launch, 1000 + len(self.started))
        self.started.append(handle)
        return handle


class StandInChannel(ControlChannel):
    """A control channel to workers that answer a ``Pause`` with what :attr:`answers` says (None: silence)."""

    def __init__(self, answers: dict[int, ToAgent | None] | None = None) -> None:
        self.path = Path("/nonexistent/control.sock")
        self.answers: dict[int, ToAgent | None] = dict(answers or {})
        self.sent: list[tuple[int, ToWorker]] = []
        self.inbox: dict[int, list[ToAgent]] = {}
        self.forgotten: list[int] = []
        self.closed = False
        #: The bound of each :meth:`wait_for`, in order.
        self.bounds: list[float] = []

    def deliver(self, pid: int, message: ToAgent) -> None:
        """A message from worker ``pid`` arrives."""
        self.inbox.setdefault(pid, []).append(message)

    def filenos(self) -> list[int]:
        return []

    def pump(self, timeout: float = 0.0) -> None:
        pass

    def connected(self, pid: int) -> bool:
        return pid in self.answers and pid not in self.forgotten

    def send(self, pid: int, message: ToWorker) -> bool:
        if not self.connected(pid):
            return False
        self.sent.append((pid, message))
        answer = self.answers.get(pid)
        if isinstance(message, Pause) and answer is not None:
            self.deliver(pid, answer)
        return True

    def take(self, pid, kind):
        box = self.inbox.get(pid, [])
        for i, message in enumerate(box):
            if isinstance(message, kind):
                return box.pop(i)
        return None

    def wait_for(self, pids, kinds, timeout):
        self.bounds.append(timeout)
        got = {}
        for pid in pids:
            for kind in kinds:
                message = self.take(pid, kind)
                if message is not None:
                    got[pid] = message
                    break
        return got

    def forget(self, pid: int) -> None:
        self.forgotten.append(pid)

    def close(self) -> None:
        self.closed = True


def round_result(round_: int = 1, generation: int = 0, nproc: int = 2, world: int | None = None,
                 offset: int = 0) -> RoundResult:
    """A closed round in which this node holds ranks ``offset`` to ``offset + nproc - 1``."""
    world = world or nproc
    return RoundResult(round=round_, generation=generation, group_rank=0, group_world_size=1, rank_offset=offset,
                       world_size=world, role_rank_offset=offset, role_world_size=world, store_addr="127.0.0.1",
                       store_port=1, members=[Member("n0", "127.0.0.1", 0, nproc, offset)])
