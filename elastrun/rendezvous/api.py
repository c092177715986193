"""The rendezvous contract: how the agents of a job agree on who is in the next worker group.

An agent owns one :class:`RendezvousHandler`.  Its life looks like this::

    handler = registry.create_handler(params)          # connects; nothing joined yet
    while True:
        result = handler.next_round(node)              # blocks until this node is in a closed round
        start_workers(result)
        while workers_running():
            change = handler.poll()                    # cheap; call every few hundred ms
            if change.aborted or change.restart_needed:
                break
        if local_failure:
            handler.report_failure(failure)            # then call next_round() again
    handler.finish(success=True)                       # exit barrier, then clean-up
    handler.close()

A *round* is one attempt to form a worker group.  Rounds are numbered per job; the result of a
closed round gives every member its group rank, the global rank of its first worker, the world
size, and the address of a store (hosted by the agent of group rank 0, fresh for each round)
from which the workers bootstrap their process group.  docs/rendezvous-protocol.md describes the
keys a backend writes and when.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastrun.shared import log


class RendezvousError(Exception):
    """Base class of rendezvous failures."""


class RendezvousTimeoutError(RendezvousError):
    """A round could not close within the join timeout; the message names what it waited for."""


class RendezvousConnectionError(RendezvousError):
    """The backend (store or etcd) cannot be reached or was lost."""


class RendezvousConfigError(RendezvousError):
    """The parameters given to a backend are wrong; the message says which and what is allowed."""


class JobFailedError(RendezvousError):
    """The job was ended for all nodes (restart budget spent, or a node aborted it).

    ``summary`` is the root-cause text that every agent prints.
    """

    def __init__(self, message: str, summary: str = "", exit_code: int = 1, cause: RoundCause | None = None) -> None:
        super().__init__(message)
        self.summary = summary
        #: 1: failed (a requeue may help); 3 (``EXIT_NO_REQUEUE``): a crash loop, do not requeue.
        self.exit_code = exit_code
        #: The culprit of the round that ended the job, when the closer's result carried it.
        self.cause = cause


class JobFinishedError(RendezvousError):
    """The job this node tried to join has already finished successfully."""


class JobNotFoundError(RendezvousError):
    """``elastrun status``: the backend answers but holds no job under the given run id."""


class StatusNotSupportedError(RendezvousError):
    """``elastrun status``: the backend has no status reader."""


#: Why a node is no longer a member: ``link`` (its agent process is gone: its liveness link closed
#: and a new connection was refused), ``silence`` (no heartbeat or lease renewal for the timeout:
#: a partition, a stopped process, a dead host), ``left`` (it left the job: a signal, pre-emption).
LOST_CAUSES = ("link", "silence", "left")


@dataclass
class NodeInfo:
    """What a node tells the others when it joins a round."""

    node_id: str
    addr: str
    nproc: int
    role: str = "default"
    hostname: str = ""
    pid: int = 0
    #: Group rank this node had in the last round it was a member of (-1: none); kept where possible.
    prev_group_rank: int = -1
    #: ``--node-rank`` for the static backend; -1 elsewhere.
    fixed_rank: int = -1
    #: TCP port on ``addr`` of this agent's liveness link (:mod:`elastrun.rendezvous.link`); 0: none.
    link_port: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeInfo:
        return cls(**json.loads(text))


@dataclass
class Member:
    """A node's place in a closed round."""

    node_id: str
    addr: str
    group_rank: int
    nproc: int
    rank_offset: int
    role: str = "default"
    role_rank_offset: int = 0
    hostname: str = ""
    #: Port of the node's liveness link on ``addr`` (0: none).
    link_port: int = 0


@dataclass
class RoundResult:
    """The outcome of a closed round, as seen by one member."""

    round: int
    #: Worker-group generation of the job: 0 for the first group, +1 for each restart or resize.
    #: Exported to workers as ``TORCHELASTIC_RESTART_COUNT``.
    generation: int
    group_rank: int
    group_world_size: int
    rank_offset: int
    world_size: int
    role_rank_offset: int
    role_world_size: int
    store_addr: str
    store_port: int
    members: list[Member] = field(default_factory=list)
    restarts_used: int = 0
    max_restarts: int = 0
    #: Seconds from this node's call to ``next_round`` until the round closed.
    duration: float = 0.0
    #: Nodes of the previous round that were declared dead or left (a membership change).
    lost_nodes: list[str] = field(default_factory=list)
    #: How each lost node was found out (see :data:`LOST_CAUSES`), by node id.
    lost_causes: dict[str, str] = field(default_factory=dict)
    #: What ended the previous round, as its closer judged it from every node's records (None: a
    #: first round, or a round that ended without a fault, e.g. for a joining node).
    cause: RoundCause | None = None


@dataclass
class RoundCause:
    """The culprit of a round's end, named to every member of the next round (and with a job's end).

    Judged by the closer from the failure records of every node and the lost nodes
    (:func:`elastrun.rendezvous.rounds.round_cause`), so that an agent whose worker failed only
    because of it can say so in one line (docs/failures.md).
    """

    node_id: str
    hostname: str
    #: The failed rank; None when the culprit is a lost node (all its ranks).
    rank: int | None
    #: ``killed by SIGKILL``, ``exit code 1``, ``hung`` or ``lost``.
    what: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Any) -> RoundCause | None:
        """The cause a result document holds, or None (absent, or not a cause: a forged value is ignored)."""
        if not isinstance(doc, dict):
            return None
        try:
            rank = doc.get("rank")
            return cls(str(doc["node_id"]), str(doc.get("hostname") or ""), None if rank is None else int(rank),
                       str(doc["what"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class RoundChange:
    """What :meth:`RendezvousHandler.poll` reports about the job since this node's round closed."""

    #: Nodes waiting to join (counted only while the group is below its maximum size).
    nodes_waiting: int = 0
    #: Members of the current round declared dead (missed heartbeats) or gone.
    lost_nodes: list[str] = field(default_factory=list)
    #: How each lost node was found out (see :data:`LOST_CAUSES`), by node id.
    lost_causes: dict[str, str] = field(default_factory=dict)
    #: Another member asked for a new round (its workers failed, or it saw a change first).
    new_round_requested: bool = False
    #: The job was ended; ``JobFailedError.summary``-style text.
    aborted: str | None = None
    #: Exit code the agents use for that end (see ``JobFailedError.exit_code``).
    abort_exit_code: int = 1

    @property
    def restart_needed(self) -> bool:
        return bool(self.nodes_waiting or self.lost_nodes or self.new_round_requested)


@dataclass
class FailureRecord:
    """One failed worker, as written to the job's store so that every agent can print the root cause."""

    node_id: str
    hostname: str
    rank: int
    local_rank: int
    exitcode: int | None
    signal: str | None
    timestamp: float
    message: str = ""
    #: Whether the failed attempt made progress on this node (heartbeats, or a long enough run).
    progress: bool = True
    #: Set by the handler when, before this failure was recorded, a member of the round had already
    #: stopped its workers for a joining node: the failure may be that stop's consequence (a peer's
    #: connection closed under it), so it is reported but not charged to the restart budget.
    after_growth: bool = False
    #: The worker's error is about its peers (a connection a peer closed, an aborted process group, a
    #: re-form signal), the mark of a consequence: the round's root cause is another fault when one is
    #: known (:func:`elastrun.rendezvous.rounds.root_cause`; the agent's rule: docs/failures.md).
    peer_error: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureRecord:
        return cls(**json.loads(text))


@dataclass
class RendezvousParameters:
    """Backend-independent settings of a job's rendezvous, built from the launch flags.

    ``config`` holds the ``--rdzv-conf`` keys; each backend reads them with
    :func:`elastrun.rendezvous.conf.read` and its table of keys, which reports unknown keys as an error.
    """

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    max_restarts: int = 0
    local_addr: str | None = None
    config: dict[str, str] = field(default_factory=dict)
    #: Failed attempts in a row without progress that end the job (0: never).
    crash_loop_limit: int = 3
    #: static backend only
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None


class RendezvousHandler(abc.ABC):
    """One node's handle on a job's rendezvous.  See the module docstring for the call sequence.

    Implementations must be safe to call from the agent's main thread while their own
    background threads (heartbeats, watches) run; they must never block in :meth:`poll`.
    """

    #: Name under which the backend is registered (``--rdzv-backend``).
    backend_name: str = ""
    #: Receives ``(message, fields)`` for each rendezvous warning (e.g. a forged value ignored);
    #: the launcher connects it to the agent's event log.  Unset, warnings go to the console
    #: (the ``elastrun.rendezvous`` logger).
    on_warning: Callable[[str, dict[str, Any]], None] | None = None

    #: Receives the line of a node that waits in the rendezvous (who joined, who is awaited, the
    #: time-out: :mod:`elastrun.rendezvous.waiting`), at most every ``wait_report_interval`` s.
    #: Unset, it goes to the console at info level (``-q`` silences it).
    on_wait: Callable[[str], None] | None = None

    def say_waiting(self, line: str) -> None:
        """Report that this node still waits in the rendezvous: to :attr:`on_wait` or the console."""
        if self.on_wait is not None:
            self.on_wait(line)
        else:
            log.get("rendezvous").info(line)

    def warn(self, message: str, **fields: Any) -> None:
        """Report a rendezvous warning: one line, to :attr:`on_warning` or the console."""
        if self.on_warning is not None:
            self.on_warning(message, fields)
        else:
            log.get("rendezvous").warning(message)

    @abc.abstractmethod
    def next_round(self, node: NodeInfo) -> RoundResult:
        """Join the job's next round and block until it closes with this node as a member.

        Raises :class:`RendezvousTimeoutError` after the join timeout, :class:`JobFailedError`
        when the job was ended (e.g. the restart budget is spent), :class:`JobFinishedError`
        when the job already finished, :class:`RendezvousConnectionError` when the backend is
        lost.
        """

    @abc.abstractmethod
    def poll(self) -> RoundChange:
        """Report changes to the current round without blocking (a few store operations at most)."""

    @abc.abstractmethod
    def report_failure(self, failure: FailureRecord) -> None:
        """Record that this node's workers failed in the current round (the root cause for the job)."""

    def claim_hang(self, failure: FailureRecord) -> str | None:
        """Claim the current round's first fault for a hung worker of this node (``failure``), before
        acting on it.

        Workers blocked in a collective on a hung peer stop their heartbeats too, so the agents of
        several nodes may each find a silent worker for one hang.  The round's first fault wins.
        None: this claim is the first, and the hang is this node's to report (dump and kill the
        worker, record the failure).  Otherwise a line naming the fault that came first (another
        node's hang or failure, a lost or departed node): this node's silent worker is taken to wait
        on it, and its group ends as for a change elsewhere, charging nothing.

        The default, for a backend that keeps no such record, is None: every agent reports its own.
        """
        return None

    def join_interrupts(self) -> bool:
        """Whether this node's join, now, would make a group that trains stand still.

        Asked by an agent before its first round only, while its own start-up still runs (the warm
        pool's template importing torch): where the job already trains a group below its maximum
        size and nobody is forming a round, joining at once would stop every member's workers for as
        long as this node takes to start its own.  The agent then finishes its start-up first, asking
        again every few tens of milliseconds, and joins at once when the answer turns False (a round
        is forming: after a fault it closes as soon as the members are back, with or without this
        node).  :func:`elastrun.rendezvous.rounds.join_interrupts` is the rule.

        A few reads, never a wait; False for a member, a job's first round, or an ended job.  The
        default, False, makes the agent join at once, as a backend that keeps no such state must.
        """
        return False

    @abc.abstractmethod
    def leave(self, reason: str) -> None:
        """Leave the job for good (pre-emption, operator stop) without charging the restart budget."""

    @abc.abstractmethod
    def finish(self, timeout: float) -> bool:
        """Record this node's success and wait up to ``timeout`` s for the other members (exit barrier).

        Returns True when every member of the round finished.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop background threads and release resources; the last node out removes the job's keys."""

    def wakeup_fileno(self) -> int | None:
        """A descriptor that turns readable when :meth:`poll` has news before the agent's next interval.

        E.g. this node's liveness link just declared its neighbour dead: the agent polls at once
        instead of up to ``--monitor-interval`` later.  :meth:`poll` clears it.  None (the
        default): the agent polls on its interval only.
        """
        return None

class RendezvousBackend(abc.ABC):
    """A rendezvous backend, as registered under a ``--rdzv-backend`` name (see ``registry``).

    One object answers everything elastrun asks of a backend: whether a job's settings are valid
    (before anything starts), the handler of one agent, and the job's status for ``elastrun status``.
    The command line, :func:`elastrun.launcher.launch` and ``elastrun status`` all go through it.
    """

    def validate(self, params: RendezvousParameters) -> None:
        """Check ``params`` (endpoint, ``--rdzv-conf``, node counts) without connecting anywhere.

        Raises :class:`RendezvousConfigError` with one line saying what is wrong.  The default
        accepts everything.
        """

    @abc.abstractmethod
    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """This agent's handler for the job (may connect; raises :class:`RendezvousError` subclasses)."""

    def read_status(self, params: RendezvousParameters, timeout: float) -> dict[str, Any]:
        """The job's state for ``elastrun status`` (docs/observe.md), read as a pure client.

        Must not host, join or write.  Raises :class:`RendezvousConnectionError` when the backend
        cannot be reached, :class:`JobNotFoundError` when it has no such job, and by default
        :class:`StatusNotSupportedError`.
        """
        raise StatusNotSupportedError(f"the {params.backend!r} rendezvous backend does not support 'elastrun status'")


@dataclass(frozen=True)
class FunctionBackend(RendezvousBackend):
    """A backend made of three functions, as each built-in one is::

        BACKEND = FunctionBackend(validate_params, create_handler, read_job_status)
    """

    check: Callable[[RendezvousParameters], None]
    factory: Callable[[RendezvousParameters], RendezvousHandler]
    status: Callable[[RendezvousParameters, float], dict[str, Any]]

    def validate(self, params: RendezvousParameters) -> None:
        self.check(params)

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        return self.factory(params)

    def read_status(self, params: RendezvousParameters, timeout: float) -> dict[str, Any]:
        return self.status(params, timeout)
