"""The local worker group: this node's workers of one round, from their start to the group's end.

The group starts a round's workers (taking back those an in-process re-form kept), watches them
(exits, the exit code each script reported before its interpreter's teardown, heartbeats), and
ends itself: it kills the workers of failed ranks and every worker that cannot re-form, and pauses
the others through the :class:`~elastrun.agent.reform_session.ReformSession`.  For a failure or a hang it
builds the :class:`FailureRecord` the rendezvous keeps.  Rounds, signals and the rendezvous are the
agent's (:mod:`elastrun.agent.agent`), which hands the group one rendezvous call: ``claim_hang``.

Silent workers (hangs) are :class:`~elastrun.agent.silence.SilenceHandling`'s: its module says how the
group picks a hang's culprit and claims it in the rendezvous.

Example (what the agent's loop does)::

    group.start(result, launches.for_round(result))
    while (end := group.check(result)) is None:
        select(group.filenos() + ..., timeout)
    if end.outcome is Outcome.FAILED: handler.report_failure(end.failure)   # Outcome: group_end.py
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import replace

from elastrun.agent.aftermath import Aftermath, is_peer_error
from elastrun.agent.group_end import GroupEnd, Outcome
from elastrun.agent.hang import HangTracker, StartupHistory
from elastrun.agent.launches import link_kept_logs
from elastrun.agent.reform_session import ReformSession
from elastrun.agent.report import AgentReport
from elastrun.agent.silence import SilenceHandling
from elastrun.agent.workers.late_reaper import LateReaper
from elastrun.agent.workers.reports import clear_reports, read_error_file, read_exit_report
from elastrun.agent.workers.starter import ExitStatus, WorkerHandle, WorkerLaunch, WorkerStarter, devices_on_host
from elastrun.config import LaunchConfig
from elastrun.rendezvous.api import FailureRecord, RoundResult
from elastrun.shared.protocol import HEARTBEAT_ENV

#: How long a hung worker has to write its stacks after SIGABRT before it is killed.
DUMP_WAIT = 3.0
#: Seconds a SIGKILLed worker may take to be reaped before its death is counted without the reaping (where
#: :attr:`WorkerGroup.act_on_kill`).  A death normally takes milliseconds, and counted at the reaping it comes
#: with all the worker wrote (its log's tail is the failure's message); a slow one is bounded by this.
KILLED_REAP_WAIT = 0.1


def _abort_for_stacks(handle: WorkerHandle) -> None:
    """SIGABRT (faulthandler writes its Python stacks, then it ends), and SIGCONT in case it is stopped."""
    handle.send_signal(signal.SIGABRT)
    handle.send_signal(signal.SIGCONT)


def _no_claims(failure: FailureRecord) -> str | None:
    return None


class WorkerGroup(SilenceHandling):
    """This node's workers of the current round (see the module docstring)."""

    def __init__(self, config: LaunchConfig, starter: WorkerStarter, session: ReformSession, report: AgentReport,
                 node_id: str, hostname: str,
                 claim_hang: Callable[[FailureRecord], str | None] = _no_claims,
                 aftermath: Aftermath | None = None) -> None:
        self.config = config
        #: The console's verdict on each ended worker: own failure in full, consequence in one line.
        self.aftermath = aftermath or Aftermath(report, node_id, None, config.verbose)
        #: The rendezvous's :meth:`~elastrun.rendezvous.api.RendezvousHandler.claim_hang` (see the module docstring).
        self.claim_hang = claim_hang
        #: When this group first found a silent worker that still runs (monotonic), until it claims.
        self._silent_since: float | None = None
        self.starter = starter
        self.session = session
        self.report = report
        self.node_id = node_id
        self.hostname = hostname
        self.workers: list[WorkerHandle] = []
        self.trackers: dict[int, HangTracker] = {}
        #: How each worker that ended did (by local rank), as the job counts it.
        self.statuses: dict[int, ExitStatus] = {}
        #: Exit codes reported by the scripts of the current workers that have returned (by local rank).
        self._exit_reports: dict[int, tuple[int, float]] = {}
        #: When each running worker was last seen alive (Unix time, by local rank): a death's earliest moment.
        self._alive_at: dict[int, float] = {}
        #: The PIDs of the workers seen on their way out whose exit was hastened (once each).
        self._hastened: set[int] = set()
        #: Whether a worker's SIGKILL counts as its death before the reaping: not on a host with GPUs (see
        #: :func:`~elastrun.agent.workers.starter.devices_on_host`).  The workers so counted, reaped later.
        self.act_on_kill = not devices_on_host()
        self.late = LateReaper()
        self._killed_at: dict[int, float] = {}  # pid -> when first seen killed and not reaped (monotonic)
        #: What this node learnt of its workers' starts, across rounds: the start-up bound (see hang.py).
        self.history = StartupHistory(config.startup_timeout, config.hang_timeout)
        #: How each worker entered the round (``"kept"`` or its start method), and the kept ones' re-forms.
        self._entered: dict[int, str] = {}
        self._reformed: dict[int, tuple[str | None, int]] = {}
        self._result: RoundResult | None = None  # the round the current workers run in

    # ------------------------------------------------------------------ start
    def start(self, result: RoundResult, launches: list[WorkerLaunch]) -> None:
        """Start the round's workers, handing kept (paused) workers their new launch instead."""
        kept = self.session.take_kept()
        self._result = result
        self.workers, self.trackers, self.statuses, self._exit_reports, self._alive_at = [], {}, {}, {}, {}
        self._entered, self._reformed, self._hastened, self._killed_at = {}, {}, set(), {}
        self._silent_since = None
        for launch in launches:
            local_rank = launch.local_rank
            hb_path = launch.env[HEARTBEAT_ENV]
            clear_reports(hb_path)
            self.trackers[local_rank] = HangTracker(hb_path, self.config.hang_timeout, self.history.bound(),
                                                    self.history.describe(), expects_beats=self.history.heartbeats)
            handle = kept.pop(local_rank, None)
            if handle is not None and not self._reassign(handle, launch, result):
                self.report.reform_fallback(handle, "gone before its new assignment")
                self._discard(handle)
                handle = None
            method = "kept"
            if handle is None:
                handle = self.starter.start(launch)
                method = handle.start_method or self.starter.name
                self.session.restarted(local_rank)
            self._entered[local_rank] = method
            self.workers.append(handle)
            self.report.worker_start(result, launch, handle.pid, method)
        for handle in kept.values():  # local ranks the new round does not have
            self._discard(handle)
        self.session.assigned(result.round)

    def _reassign(self, handle: WorkerHandle, launch: WorkerLaunch, result: RoundResult) -> bool:
        """Hand a paused worker the new round (it keeps its process, error file and log files)."""
        old = handle.launch
        env = dict(launch.env)
        env["TORCHELASTIC_ERROR_FILE"] = old.env.get("TORCHELASTIC_ERROR_FILE", env["TORCHELASTIC_ERROR_FILE"])
        new = replace(launch, env=env, error_file=old.error_file, stdout_path=old.stdout_path,
                      stderr_path=old.stderr_path)
        if not self.session.assign(handle, env, result.round):
            return False
        handle.launch = new
        link_kept_logs(old, launch)
        handle.set_console_prefix(new.console_prefix)
        return True

    # ------------------------------------------------------------------ watch
    def filenos(self) -> list[int]:
        """The running workers' descriptors (readable once a worker exits)."""
        return [h.fileno() for h in self.workers if h.launch.local_rank not in self.statuses]

    def check(self, result: RoundResult) -> GroupEnd | None:
        """Look at every worker once: how the group ended, or None while it runs."""
        news = self.session.watch(self.workers)
        for handle, failed in news.failed:
            self.report.reform_failed(handle.launch.rank, failed.error)
            self.report.reform_fallback(handle, f"could not join the new group: {failed.error[-200:]}")
        if self.session.pending is not None:
            self._reformed.update({lr: (r.source, r.step) for lr, r in self.session.pending.reformed.items()})
        if news.done is not None:
            done = news.done
            self._reformed.update({lr: (r.source, r.step) for lr, r in done.reformed.items()})
            self.report.reform(result.round, time.monotonic() - done.detected_at, done.paused_in, sorted(done.kept),
                               sorted(done.restarted), done.sources, done.step, done.at_commit)
        self.late.reap()
        for handle in [h for h in self.workers if h.launch.local_rank not in self.statuses]:
            polled = time.time()
            status = handle.poll()
            if status is None:
                status = self._teardown_overdue(handle)
            if status is None:
                if not handle.dying():
                    self._alive_at[handle.launch.local_rank] = polled
                    continue
                if handle.pid not in self._hastened:  # on its way out: it runs none of its script, and
                    self._hastened.add(handle.pid)  # its idle-priority threads must not hold up its end
                    handle.hasten()
                if not (self.act_on_kill and handle.killed()):
                    continue
                seen = self._killed_at.setdefault(handle.pid, time.monotonic())
                if time.monotonic() - seen < KILLED_REAP_WAIT:
                    continue
                # Killed and slow to end: its status can only say SIGKILL; the group goes on without its end.
                status = ExitStatus(exitcode=None, signal=signal.SIGKILL, timestamp=time.time())
                self.late.add(handle)
            self._record_exit(result, handle, status)
        failed = [(h, self.statuses[h.launch.local_rank]) for h in self.workers
                  if h.launch.local_rank in self.statuses and not self.statuses[h.launch.local_rank].succeeded]
        if failed:
            detected = time.monotonic()
            kept = self.end({h.launch.local_rank for h, _ in failed}, detected, quiet=True)
            failure = self._failure_record(result, failed)
            self.aftermath.judged(failure)
            self._say_paused(kept)  # after the failure: the culprit comes first on the console
            return GroupEnd(Outcome.FAILED, failure, f"the failure of rank {failure.rank}", detected)
        if len(self.statuses) == len(self.workers):
            return GroupEnd(Outcome.SUCCEEDED)
        silent = self._silent(result)
        if silent:
            return self._on_silence(result, silent)
        self._silent_since = None
        return None

    def _exit_report(self, handle: WorkerHandle) -> tuple[int, float] | None:
        """The exit code the worker's script returned with (and when), once it has returned."""
        local_rank = handle.launch.local_rank
        report = self._exit_reports.get(local_rank)
        if report is None:
            report = read_exit_report(self.trackers[local_rank].path)
            if report is not None:
                self._exit_reports[local_rank] = report
        return report

    def _teardown_overdue(self, handle: WorkerHandle) -> ExitStatus | None:
        """Kill a worker still alive ``--stop-timeout`` after its script returned; its status then.

        Only the interpreter's exit is left to such a worker (threads, ``atexit``): a hang there
        must not hold the job, whose work this worker has done.
        """
        report = self._exit_report(handle)
        if report is None or time.time() - report[1] < self.config.stop_timeout:
            return None
        handle.send_signal(signal.SIGKILL)
        return handle.wait(5.0)

    def _judge_exit(self, result: RoundResult, handle: WorkerHandle, status: ExitStatus) -> ExitStatus:
        """A worker's status as the job counts it: the script's own exit code once it has returned.

        A signal death or an exit code that differs from the one the script returned with happened
        in interpreter teardown (torch's process-group destructor races): warn, keep the script's
        code, spend nothing.  Before the script returned, every death stays what it is.
        """
        report = self._exit_report(handle)
        if report is None or (status.signal is None and status.exitcode == report[0]):
            return status
        self.report.teardown_fault(result, handle, status, report[0], time.time() - report[1])
        return ExitStatus(exitcode=report[0], signal=None, timestamp=status.timestamp)

    def _failure_record(self, result: RoundResult, failed: list[tuple[WorkerHandle, ExitStatus]]) -> FailureRecord:
        records = []
        for handle, status in failed:
            from_file = read_error_file(handle.launch.error_file)
            if from_file is not None:
                message = from_file[0]
            else:
                if handle.poll() is not None:  # a worker kept for a re-form keeps its streams
                    handle.close()
                message = handle.stderr_tail()
            records.append(FailureRecord(node_id=self.node_id, hostname=self.hostname, rank=handle.launch.rank,
                                         local_rank=handle.launch.local_rank, exitcode=status.exitcode,
                                         signal=status.signal_name, timestamp=status.timestamp,
                                         message=message[-8000:],
                                         peer_error=is_peer_error(message, status.signal_name)))
            self.aftermath.failed(handle, records[-1])
        first = min(records, key=lambda r: (r.peer_error, r.timestamp, r.rank))  # rounds.root_cause's order
        first.progress = any(t.made_progress() for t in self.trackers.values())
        self.report.worker_failure(result, first)
        return first

    # ------------------------------------------------------------------ end
    def end(self, doomed: set[int], detected_at: float, dump: bool = False,
            dumping: WorkerHandle | None = None, quiet: bool = False, within: float = 0.0) -> list[WorkerHandle]:
        """End the group: kill the workers of ``doomed`` local ranks and every worker that cannot
        re-form in process; pause the others (kept for the next round, returned).

        ``dump``: a worker that was asked to leave and did not is sent SIGABRT first (its Python
        stacks go to its stderr), as a hung worker is.  ``dumping``: a doomed worker (a hung one)
        sent SIGABRT instead of SIGKILL, with :data:`DUMP_WAIT` s to write its stacks: at once if it
        runs; if it is frozen, cut off its peers first (:mod:`~elastrun.agent.workers.cutoff`) and let
        run (SIGCONT) only once the others here have left their group.  ``quiet``: the caller says
        who was kept.  ``within``: the workers may first reach the end of their next ``commit()``, if
        it comes within that many seconds (a join: the group is whole; see ``ReformSession.pause``).
        """
        self._note_deaths()
        live = dumping if dumping is not None and dumping.poll() is None else None
        frozen = live is not None and live.frozen()
        if live is not None and frozen:
            live.cut_off()  # its peers, here and on other nodes, see it gone while it sends nothing
        elif live is not None:
            _abort_for_stacks(live)
        dump_deadline = time.monotonic() + DUMP_WAIT
        for handle in self.workers:
            if handle.launch.local_rank in doomed and handle is not dumping and handle.poll() is None:
                handle.send_signal(signal.SIGKILL)
        candidates = [h for h in self.workers if h.launch.local_rank not in doomed]
        kept, asked = self.session.pause(candidates, detected_at, within)
        if live is not None and frozen and live.poll() is None:
            _abort_for_stacks(live)
            dump_deadline = time.monotonic() + DUMP_WAIT
        for handle in asked:
            if handle.pid in self.session.refused:
                self.report.reform_fallback(handle, self.session.refused[handle.pid])
        stuck = [h for h in asked if h not in kept and h.poll() is None]
        dumped = [dumping] if dumping is not None else []
        if dump and stuck:
            for handle in stuck:
                _abort_for_stacks(handle)
            dumped += stuck
            dump_deadline = time.monotonic() + DUMP_WAIT
        for handle in dumped:
            handle.wait(max(0.0, dump_deadline - time.monotonic()))
        for handle in self.workers:
            if handle not in kept:
                self._discard(handle)
        if not quiet:
            self._say_paused(kept)
        return kept

    def _note_deaths(self) -> None:
        """Record the exit of each worker found dead as the group ends before its death was looked at
        (the round ended for another reason first: another node's failure report, read from the
        rendezvous, can come before this node's next look at its own killed worker).  Without this the
        event log never named that worker's death, and goodput knew the fault only from the peer it
        cut off."""
        if self._result is None:
            return
        for handle in self.workers:
            status = handle.poll() if handle.launch.local_rank not in self.statuses else None
            if status is not None:
                self._record_exit(self._result, handle, status)

    def _record_exit(self, result: RoundResult, handle: WorkerHandle, status: ExitStatus) -> None:
        """A worker's process ended: its status as the job counts it, and its ``worker_exit`` event."""
        local_rank = handle.launch.local_rank
        self.statuses[local_rank] = self._judge_exit(result, handle, status)
        self.report.worker_exit(result, handle, self.statuses[local_rank], self._alive_at.get(local_rank))

    def _say_paused(self, kept: list[WorkerHandle]) -> None:
        if kept and self.session.pending is not None:
            pending = self.session.pending
            self.report.workers_paused([(h.launch.rank, h.pid) for h in kept], pending.paused_in, pending.at_commit)

    def forward_signal(self, signum: int, grace: float) -> None:
        """Send ``signum`` to every worker, wait up to ``grace`` seconds for them, then kill the rest."""
        for handle in self.workers:
            handle.send_signal(signum)
        deadline = time.monotonic() + grace
        for handle in self.workers:
            handle.wait(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _discard(self, handle: WorkerHandle) -> None:
        """Kill and reap one worker (one already counted dead is reaped by a later look)."""
        self.session.forget(handle)
        if handle in self.late:
            return
        if handle.poll() is None:
            handle.send_signal(signal.SIGKILL)
        handle.wait(5.0)
        handle.close()
        self.aftermath.stopped([handle])

    def kill(self) -> None:
        """SIGKILL every worker's process group and reap them."""
        for handle in self.workers:
            if handle.poll() is None:
                handle.send_signal(signal.SIGKILL)
        for handle in self.workers:
            if handle not in self.late:
                handle.wait(5.0)
                handle.close()
        self.late.reap(timeout=5.0)  # killed already: nothing of theirs runs if they outlast the agent
        self.aftermath.stopped(self.workers)
