"""What a worker group does about silent workers: find them, pick a hang's culprit, claim it, end.

A hang has one culprit and often several silent workers: those blocked in a collective on the hung
one stop their heartbeats too, on this node and on others.  The group picks the culprit among its
silent workers (a frozen one, else the one silent the longest), and claims the round's first fault
in the rendezvous before acting (:meth:`~elastrun.rendezvous.api.RendezvousHandler.claim_hang`).
The first claim is the hang: its worker's stacks are dumped (SIGABRT, faulthandler) and it is killed
at once while the others are paused.  A node that finds another fault claimed first ends its group
as for a change elsewhere, blaming nobody: its silent workers leave their group like the others
(one that cannot is the fallback: dumped and restarted after ``--reform-timeout``).  A silent worker
that is still running may only wait on a peer, so its node claims after :data:`HANG_GRACE` (when the
round has other nodes): a node whose worker is frozen claims first.  Nor is it blamed while a worker
of its own node is frozen: that one, which may have beaten a moment later, is silent within its own
timeout, and is then the culprit.

:class:`SilenceHandling` is a part of :class:`~elastrun.agent.group.WorkerGroup`, which owns its state
(``workers``, ``statuses``, ``trackers``, ``history``, ``claim_hang``, ``_silent_since``, ``_entered``,
``_reformed``; see its ``__init__``) and the calls it ends a group with (``end``, ``_failure_record``,
``_exit_report``).
"""

from __future__ import annotations

import signal
import time

from elastrun.agent import stall
from elastrun.agent.group_end import GroupEnd, Outcome
from elastrun.agent.workers.starter import ExitStatus, WorkerHandle
from elastrun.rendezvous.api import FailureRecord, RendezvousError, RoundResult

#: Seconds a node whose silent worker still runs waits before it claims the round's hang (or 3
#: ``--monitor-interval``, if longer): the node of a frozen worker, which finds the same silence
#: within about one monitor interval, claims first.
HANG_GRACE = 1.0


def _killed() -> ExitStatus:
    return ExitStatus(exitcode=None, signal=signal.SIGKILL, timestamp=time.time())


class SilenceHandling:
    """The silent-worker part of :class:`~elastrun.agent.group.WorkerGroup` (see the module docstring)."""

    def _silent(self, result: RoundResult) -> list[tuple[WorkerHandle, str]]:
        """The running workers silent past their hang timeout, with how each is silent."""
        now = time.time()
        out = []
        for handle in self.workers:
            if handle.launch.local_rank in self.statuses or self._exit_report(handle) is not None:
                continue
            tracker = self.trackers[handle.launch.local_rank]
            reason = tracker.check(now)
            first_beat = tracker.take_first_beat()
            if first_beat is not None:
                self.history.stepped(max(0.0, first_beat - tracker.started))
                self.report.worker_stepping(result, handle, first_beat, tracker.started)
            if reason is not None:
                out.append((handle, reason))
        return out

    def _on_silence(self, result: RoundResult, silent: list[tuple[WorkerHandle, str]]) -> GroupEnd | None:
        """Pick the culprit among the silent workers, claim the round's hang, and end the group (None:
        a running culprit in a round of several nodes waits out :data:`HANG_GRACE` first)."""
        frozen = [(h, why) for h, why in silent if h.frozen()]
        handle, reason = frozen[0] if frozen else min(
            silent, key=lambda hw: (self.trackers[hw[0].launch.local_rank].last_beat or 0.0, hw[0].launch.local_rank))
        now = time.monotonic()
        if not frozen and self._frozen_but_not_yet_silent(silent):
            return None  # that one is silent within its own timeout, and then the culprit
        if not frozen and result.group_world_size > 1:
            self._silent_since = now if self._silent_since is None else self._silent_since
            if now - self._silent_since < max(HANG_GRACE, 3 * self.config.monitor_interval):
                return None
        if self.trackers[handle.launch.local_rank].stalled_at_startup:
            self.history.stalled()
        try:
            first = self.claim_hang(self._hang_record(handle, reason))
        except RendezvousError as exc:  # unanswered: this node reports its own hang, as every node did before claims
            self.report.detail(f"could not claim the hang in the rendezvous: {exc}")
            first = None
        # Before anything is paused or killed: what every local worker was doing, and its stacks (the
        # culprit of this node's own hang leaves them through SIGABRT as it is killed).
        dumped = [h for h in self.workers if h.poll() is None and (first is not None or h is not handle)
                  and h.dump_stacks()]
        self.report.stall(result, reason, self._states(result, dict(silent)), [h.launch.rank for h in dumped])
        if first is not None:
            return self._end_behind(result, handle, reason, first)
        return self._end_for_hang(result, handle, reason)

    def _frozen_but_not_yet_silent(self, silent: list[tuple[WorkerHandle, str]]) -> bool:
        """Whether a local worker that is not yet past its hang timeout is frozen now.  Two ranks that
        beat a moment apart go silent a moment apart: when the one frozen beat last, its peer (blocked on
        it) is silent first, and would be blamed by a check that fell in between.  A frozen worker's
        beats cannot advance, so the wait for it is bounded by its hang timeout."""
        silent_ranks = {h.launch.local_rank for h, _ in silent}
        return any(h.frozen() for h in self.workers if h.launch.local_rank not in silent_ranks
                   and h.launch.local_rank not in self.statuses and h.poll() is None)

    def _states(self, result: RoundResult, silent: dict[WorkerHandle, str]) -> list[stall.WorkerState]:
        """Every running local worker's state, for the report of a hang or a stall."""
        now = time.time()
        out = []
        for handle in self.workers:
            local_rank = handle.launch.local_rank
            if local_rank in self.statuses:
                continue
            tracker = self.trackers[local_rank]
            out.append(stall.WorkerState(
                rank=handle.launch.rank, local_rank=local_rank, pid=handle.pid,
                entered=self._entered.get(local_rank, "?"), since_start=now - tracker.started, beats=tracker.beats,
                last_beat_ago=None if tracker.last_beat is None else now - tracker.last_beat,
                reformed=self._reformed.get(local_rank),
                record=stall.last_record(handle.launch.env, handle.launch.error_file, handle.pid, now, result.round),
                silent=silent.get(handle)))  # fmt: skip
        return out

    def _hang_record(self, handle: WorkerHandle, reason: str) -> FailureRecord:
        """The claim of a hang (the failure record itself comes once the worker is dead)."""
        return FailureRecord(node_id=self.node_id, hostname=self.hostname, rank=handle.launch.rank,
                             local_rank=handle.launch.local_rank, exitcode=None, signal=None, timestamp=time.time(),
                             message=f"hang detected: {reason}")

    def _end_for_hang(self, result: RoundResult, handle: WorkerHandle, reason: str) -> GroupEnd:
        """The hang is this node's: dump the worker's Python stacks (faulthandler on SIGABRT) and kill
        it, pause the others meanwhile, and record the failure."""
        detected = time.monotonic()
        self.report.hang_detected(result, handle, reason)
        self.end({handle.launch.local_rank}, detected, dump=True, dumping=handle)
        status = handle.poll() or _killed()
        failure = self._failure_record(result, [(handle, status)])
        failure.message = f"hang detected: {reason}\n{failure.message}"
        failure.peer_error = False
        self.aftermath.judged(failure, say=False)
        return GroupEnd(Outcome.FAILED, failure, f"the hang of rank {handle.launch.rank}", detected)

    def _end_behind(self, result: RoundResult, handle: WorkerHandle, reason: str, first: str) -> GroupEnd:
        """Another fault of the round came first: the silent worker is taken to wait on it.  The group
        ends as for a change elsewhere; a worker that cannot leave its group is dumped and restarted,
        at once when it is frozen (it cannot answer a pause), else after ``--reform-timeout``."""
        detected = time.monotonic()
        why = f"rank {handle.launch.rank} waits on {first}"
        self.report.hang_elsewhere(result, handle, reason, first)
        if handle.frozen():
            self.end({handle.launch.local_rank}, detected, dump=True, dumping=handle)
        else:
            self.end(set(), detected, dump=True)
        return GroupEnd(Outcome.MEMBERSHIP, reason=why, detected_at=detected)
