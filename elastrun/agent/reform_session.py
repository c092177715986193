"""The agent's side of in-process re-forms: pause the workers that opted in, hand them the next round.

Workers whose script runs ``elastrun.train.run`` connect to the agent's control channel
(:mod:`elastrun.agent.workers.control_server`, messages in :mod:`elastrun.shared.protocol`).  When the agent would kill
its workers for a new round (a local failure, a hang, a change elsewhere), :meth:`ReformSession.pause`
instead asks those that are alive and connected to leave their process group, and waits — at most
``--reform-timeout`` seconds, plus :data:`COMMIT_WAIT` for a join, whose workers first finish their
step and leave at the end of its ``commit()`` — for each to say it did.  Those that answer are kept: once the next
round has closed the worker group takes them back (:meth:`ReformSession.take_kept`) and
:meth:`ReformSession.assign` sends each its new environment; it joins the new group in the same
process and says ``Reformed``.  Those that do not answer in time are killed and started again, as
every worker of a script that did not opt in is (the fallback: never a hang, never a worker left
in an old group).

The session's phases (docs/train.md, "The re-form protocol", draws them with the messages):
IDLE, then PAUSED once :meth:`~ReformSession.pause` kept someone, ASSIGNED once the new group has
handed the kept workers their round (:meth:`~ReformSession.assigned`), and IDLE again when every
one of them said ``Reformed`` (:meth:`~ReformSession.watch`).  A pause that keeps nobody, or a new
change before the re-form completed, starts over from IDLE.

The session is the node service that owns the channel: the node runtime hands its variables to
every worker and its descriptors to the agent's loop.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from elastrun.agent.runtime import NodeService
from elastrun.agent.workers.control_server import ControlChannel
from elastrun.agent.workers.starter import WorkerHandle, thread_states
from elastrun.shared.protocol import SOCKET_ENV, WAIT_ENV, Assign, Failed, Pause, Paused, Reformed

#: How long a worker whose group broke on its own (a peer died) waits for its agent's pause: the
#: agent hears of a dead peer through the rendezvous (a reported failure, a missed heartbeat).
WORKER_WAIT = 30.0
#: How long workers asked to pause for a join may go on to the end of their next ``commit()``
#: (:mod:`elastrun.train.commit_pause`): the joiner's round waits that much at most for them.
COMMIT_WAIT = 5.0


class Phase(enum.Enum):
    IDLE = "idle"  # no re-form under way
    PAUSED = "paused"  # workers left their group and wait for the next round
    ASSIGNED = "assigned"  # the kept workers have the round's environment; waiting for each one's Reformed


@dataclass
class PendingReform:
    """A re-form under way: when the change was seen, and which local ranks kept their process."""

    detected_at: float
    paused_in: float
    #: Every kept worker left at the end of a commit (nothing of a step was thrown away).
    at_commit: bool = False
    kept: dict[int, int] = field(default_factory=dict)  # local rank -> pid, once assigned
    restarted: list[int] = field(default_factory=list)  # local ranks started anew
    reformed: dict[int, Reformed] = field(default_factory=dict)  # local rank -> the worker's report
    round: int | None = None

    @property
    def sources(self) -> list[str]:
        """Where the kept workers' state came from (``live``, ``memory``, ``peer``, ``disk``)."""
        return sorted({str(r.source) for r in self.reformed.values()})

    @property
    def step(self) -> int:
        return max((r.step or 0) for r in self.reformed.values())


@dataclass
class ReformNews:
    """What :meth:`ReformSession.watch` learnt: workers that could not re-form, and the re-form completed."""

    failed: list[tuple[WorkerHandle, Failed]] = field(default_factory=list)
    done: PendingReform | None = None


class ReformSession(NodeService):
    """Pauses, keeps and re-assigns the workers that opted in; owns the re-form under way.

    ``channel`` is None when re-forms are off (``--reform-timeout=0``): every call is then a no-op
    and every worker is killed and restarted.
    """

    def __init__(self, channel: ControlChannel | None, timeout: float) -> None:
        self.channel = channel
        self.timeout = timeout
        self.phase = Phase.IDLE
        #: The re-form under way (None when idle).
        self.pending: PendingReform | None = None
        #: Paused workers kept for the next round, by local rank (until :meth:`take_kept`).
        self._kept: dict[int, WorkerHandle] = {}
        #: Why each worker asked by the last :meth:`pause` was not kept (restarted instead), by PID.
        self.refused: dict[int, str] = {}

    # -- node service ------------------------------------------------------------------------
    def worker_env(self) -> dict[str, str]:
        """What every worker's environment gets (nothing when re-forms are off)."""
        if self.channel is None:
            return {}
        return {SOCKET_ENV: str(self.channel.path), WAIT_ENV: f"{WORKER_WAIT:g}"}

    def filenos(self) -> list[int]:
        return self.channel.filenos() if self.channel is not None else []

    def pump(self) -> None:
        if self.channel is not None:
            self.channel.pump(0.0)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    # -- the re-form --------------------------------------------------------------------------
    def opted_in(self, handle: WorkerHandle) -> bool:
        """Whether this live worker is connected, so it can be paused instead of killed."""
        return self.channel is not None and handle.poll() is None and self.channel.connected(handle.pid)

    def pause(self, handles: list[WorkerHandle], detected_at: float,
              within: float = 0.0) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
        """Ask the live, opted-in ``handles`` to leave their group: ``(kept, asked)``, kept being those
        that said they did within the bound.  Starts a new re-form (PAUSED), or none (IDLE).

        ``within`` > 0 (the group is whole: a node joins): they may first finish their step, leaving
        at the end of a ``commit()`` that comes within that many seconds; the bound grows by as much."""
        self.pending = None
        self._kept = {}
        self.refused = {}
        self.phase = Phase.IDLE
        if self.channel is None:
            return [], []
        self.pump()
        asked = [h for h in handles if self.opted_in(h) and self.channel.send(h.pid, Pause(within=within))]
        if not asked:
            return [], []
        t0 = time.monotonic()
        answers = self.channel.wait_for([h.pid for h in asked], (Paused, Failed), self.timeout + within)
        kept = [h for h in asked if isinstance(answers.get(h.pid), Paused) and h.poll() is None]
        for h in asked:
            if h not in kept:
                self.refused[h.pid] = self._refusal(h, answers.get(h.pid), within)
        if kept:
            self._kept = {h.launch.local_rank: h for h in kept}
            self.pending = PendingReform(detected_at=detected_at, paused_in=time.monotonic() - t0,
                                         at_commit=all(getattr(answers[h.pid], "at_commit", False) for h in kept))
            self.phase = Phase.PAUSED
        return kept, asked

    def _refusal(self, handle: WorkerHandle, answer: object, within: float) -> str:
        """Why an asked worker is not kept."""
        if isinstance(answer, Failed):
            return f"could not leave its group: {answer.error[-200:]}"
        if handle.poll() is not None:
            return "exited while leaving its group"
        threads = thread_states(handle.pid)  # Python's stacks come next (SIGABRT); the kernel's view is lost then
        extra = f", after {within:g} s to reach its next commit" if within else ""
        return f"no answer to the pause within --reform-timeout ({self.timeout:g} s{extra})" + (
            f"; its threads then: {threads}" if threads else "")

    def take_kept(self) -> dict[int, WorkerHandle]:
        """The paused workers, by local rank, for the new group to take back or discard."""
        kept, self._kept = self._kept, {}
        return kept

    def assign(self, handle: WorkerHandle, env: dict[str, str], round_: int) -> bool:
        """Send a kept worker the new round's environment; False if it is gone."""
        if self.channel is None or handle.poll() is not None:
            return False
        if not self.channel.send(handle.pid, Assign(env=env, round=round_)):
            return False
        if self.pending is not None:
            self.pending.kept[handle.launch.local_rank] = handle.pid
        return True

    def restarted(self, local_rank: int) -> None:
        """Note a local rank the new group starts anew while others re-form."""
        if self.pending is not None:
            self.pending.restarted.append(local_rank)

    def assigned(self, round_: int) -> None:
        """The new group is complete: wait for the kept workers' ``Reformed`` (or end, if none was kept)."""
        if self.pending is None:
            return
        self.pending.round = round_
        if self.pending.kept:
            self.phase = Phase.ASSIGNED
        else:
            self.pending, self.phase = None, Phase.IDLE

    def forget(self, handle: WorkerHandle) -> None:
        """A worker is being killed: close its connection."""
        if self.channel is not None:
            self.channel.forget(handle.pid)

    def watch(self, handles: list[WorkerHandle]) -> ReformNews:
        """Read the kept workers' reports; the re-form is done (and the session idle) once all re-formed."""
        news = ReformNews()
        pending = self.pending
        if pending is None or self.channel is None or self.phase is not Phase.ASSIGNED:
            return news
        for handle in handles:
            local_rank = handle.launch.local_rank
            if local_rank not in pending.kept:
                continue
            failed = self.channel.take(handle.pid, Failed)
            if failed is not None:
                news.failed.append((handle, failed))
            done = self.channel.take(handle.pid, Reformed)
            if done is not None:
                pending.reformed[local_rank] = done
        if len(pending.reformed) >= len(pending.kept):
            news.done, self.pending, self.phase = pending, None, Phase.IDLE
        return news
