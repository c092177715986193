"""What the console says when a worker group ends: the culprit's failure in full, each consequence in one line.

When a worker dies, the ranks waiting on it in a collective fail too: gloo's "Connection closed by
peer", NCCL's "remote process exited", an aborted process group.  Their tracebacks are true but
point at the wrong rank, and they reach the console first.  The rule (docs/failures.md):

- A worker's error is a **peer error** when what it raised is about its peers, not its own code
  (:func:`is_peer_error`).  It is marked on its :class:`~elastrun.rendezvous.api.FailureRecord`.
- The round's **culprit** is its earliest failure whose error is the worker's own; failing that, a
  lost node; failing that, its earliest failure (:func:`elastrun.rendezvous.rounds.round_cause`).
- A failed worker with a peer error that is not the culprit, and a worker the agent stopped for
  another fault, is a **consequence**: its traceback stays in its error and log files, and the
  console gets one line, ``rank 0 stopped: its peer rank 1 died (its traceback: PATH)``.
- Everything else is shown as it was printed, then the agent's line: a worker's own failure is
  never hidden, whatever came first; nor is an error the agent cannot explain.

The workers' stream pumps hold a dying worker's traceback back from the console until it is judged
(:mod:`elastrun.agent.workers.logs`).  The culprit is known at once when this node holds it (a failure of
its own that is not a peer error, a hang), else when the next round forms (its closer judges from
every node's records: ``RoundResult.cause``) or the job ends (``JobFailedError.cause``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from elastrun.agent.report import AgentReport
from elastrun.agent.workers.reports import read_error_file
from elastrun.agent.workers.starter import WorkerHandle
from elastrun.rendezvous.api import FailureRecord, RoundCause, RoundResult

#: Errors about a worker's peers, not its own code (searched in the exception a worker died of).
_PEER_ERRORS = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|remote process exited|ncclRemoteError"
    r"|communicator was aborted|process ?group\b.*\babort|\bDistNetworkError\b",
    re.IGNORECASE,
)
#: elastrun's own re-form signal (``elastrun.train.Reform``), when it ends a worker.
_REFORM = re.compile(r"(^|\.)Reform\b")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_HEADER = "Traceback (most recent call last):"


def exception_text(message: str) -> str:
    """The exception a worker died of: what follows the frames of its last traceback in ``message``
    (the exception line, a multi-line message, native frames), or the last lines when there is none."""
    lines = [_RANK_PREFIX.sub("", line) for line in message.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith(_HEADER)]
    if not starts:
        return "\n".join(lines[-10:])
    after = lines[starts[-1] + 1:]
    first = next((i for i, line in enumerate(after) if line and not line[0].isspace()), len(after))
    return "\n".join(after[first:])


def is_peer_error(message: str, signal: str | None = None) -> bool:
    """Whether a worker that died with ``message`` (its traceback or stderr tail) and ``signal`` failed
    on its peers: a connection a peer closed, an aborted process group, elastrun's re-form signal.

    A SIGKILL is never one: something outside the worker killed it (an operator, the OOM killer).
    """
    if signal == "SIGKILL":
        return False
    text = exception_text(message)
    return bool(_PEER_ERRORS.search(text) or any(_REFORM.search(line) for line in text.splitlines()[:1]))


def first_line(message: str) -> str:
    """The first line of the exception in ``message``, for a one-line mention."""
    lines = [line.strip() for line in exception_text(message).splitlines() if line.strip()]
    return lines[0][:200] if lines else ""


def fault_name(cause: RoundCause, node_id: str) -> str:
    """``the failure of rank 1`` (``on HOST`` when it is another node's), ``the hang of rank 1``."""
    where = "" if cause.node_id == node_id else f" on {cause.hostname or cause.node_id}"
    if cause.rank is None:
        return f"the loss of node {cause.hostname or cause.node_id}"
    return f"the {'hang' if cause.what == 'hung' else 'failure'} of rank {cause.rank}{where}"


@dataclass
class _Ended:
    handle: WorkerHandle
    #: Its failure record; None for a worker the agent stopped (killed) for another fault.
    failure: FailureRecord | None


class Aftermath:
    """The ended workers of this node whose console verdict is pending, and the lines that settle them.

    ``log_dir``: the job's ``--log-dir`` (None: error files live in the agent's temporary directory,
    removed at its exit, so a one-line verdict names the error instead of a file).
    """

    def __init__(self, report: AgentReport, node_id: str, log_dir: Path | None, verbose: bool = False) -> None:
        self.report = report
        self.node_id = node_id
        self.log_dir = log_dir
        self.verbose = verbose
        self._pending: dict[int, _Ended] = {}

    # ------------------------------------------------------------------ what the group tells
    def stopped(self, handles: list[WorkerHandle]) -> None:
        """The agent ended these workers (killed them): each awaits the verdict (a line if it held a traceback)."""
        for handle in handles:
            if handle.pid not in self._pending:
                self._pending[handle.pid] = _Ended(handle, None)

    def failed(self, handle: WorkerHandle, failure: FailureRecord) -> None:
        """A worker failed with ``failure`` (its ``peer_error`` decided by :func:`is_peer_error`)."""
        self._pending[handle.pid] = _Ended(handle, failure)

    def judged(self, first: FailureRecord, say: bool = True) -> None:
        """The group ended with failures; ``first`` is the one this node reports for the round.

        Own failures are shown now (held traceback, then the agent's line unless ``say`` is False: a
        hang was said already).  When ``first`` is one, it is the culprit of every consequence here.
        """
        own = sorted((e for e in self._pending.values() if e.failure is not None and not e.failure.peer_error),
                     key=lambda e: (e.failure is not first, e.handle.launch.rank))
        for ended in own:
            del self._pending[ended.handle.pid]
            ended.handle.release_console()
            if say:
                assert ended.failure is not None
                self.report.worker_failed(ended.failure)
        if not first.peer_error:
            what = "hung" if first.message.startswith("hang detected") else (
                f"killed by {first.signal}" if first.signal else f"exit code {first.exitcode}")
            self.settle(RoundCause(first.node_id, first.hostname, first.rank, what))

    # ------------------------------------------------------------------ verdicts
    def settle(self, cause: RoundCause | None, ran_in: RoundResult | None = None) -> None:
        """Give every pending worker its verdict against the round's culprit ``cause`` (None: unknown,
        so each is shown in full).  ``ran_in``: the round they ran in (names a lost node's ranks)."""
        pending, self._pending = self._pending, {}
        for ended in sorted(pending.values(), key=lambda e: e.handle.launch.rank):
            failure, handle = ended.failure, ended.handle
            if failure is None and not handle.console_held():
                handle.release_console()  # it printed nothing of its end; whatever comes late is shown
                continue
            culprit = cause is not None and cause.node_id == self.node_id and cause.rank == handle.launch.rank
            if cause is None or culprit:
                handle.release_console()
                if failure is not None:
                    self.report.worker_failed(failure)
                continue
            if self.verbose:
                handle.release_console()
            else:
                handle.drop_console()
            message = failure.message if failure is not None else self._message(handle)
            self.report.worker_stopped(handle.launch.rank, self._because(cause, ran_in), self._kept(handle),
                                       first_line(message))

    def _because(self, cause: RoundCause, ran_in: RoundResult | None) -> str:
        if cause.rank is None:
            member = next((m for m in ran_in.members if m.node_id == cause.node_id), None) if ran_in else None
            name = cause.hostname or (member.hostname if member else "") or cause.node_id
            ranks = f" (ranks {member.rank_offset}-{member.rank_offset + member.nproc - 1})" if member else ""
            return f"its peer node {name}{ranks} was lost"
        where = "" if cause.node_id == self.node_id else f" on {cause.hostname or cause.node_id}"
        return f"its peer rank {cause.rank}{where} " + ("hung" if cause.what == "hung" else "died")

    def _kept(self, handle: WorkerHandle) -> str | None:
        """Where the worker's traceback outlives the job (its error file or stderr log under --log-dir)."""
        if self.log_dir is None:
            return None
        for path in (handle.launch.error_file, handle.launch.stderr_path):
            if path is not None and path.exists():
                try:
                    return os.path.relpath(path) if not os.path.relpath(path).startswith("..") else str(path)
                except ValueError:
                    return str(path)
        return None

    def _message(self, handle: WorkerHandle) -> str:
        from_file = read_error_file(handle.launch.error_file)
        return from_file[0] if from_file is not None else handle.stderr_tail()
