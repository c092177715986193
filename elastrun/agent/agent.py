"""The node agent: joins rounds, starts and watches the local workers, and reacts to every change.

One agent runs per node.  Its loop::

    while True:
        (a first join into a job that trains waits for this node's start-up: see join_gate.py)
        result = rendezvous.next_round(node)      # blocks until a worker group is formed
        start nproc workers with the round's ranks
        watch them (pidfds, woken the moment one exits) and the rendezvous (every monitor interval)
        on success: exit barrier, exit 0
        on a local failure: kill the local group, record the failure, go round again
        on a change elsewhere (node lost, node waiting, another node's failure): kill, go round again
        (workers of an ``elastrun.train.run`` script are paused instead of killed, and handed the
        next round in their own process: see ``elastrun/agent/reform_session.py``)
        on a job abort (budget spent): print the root cause, exit 1
        on SIGTERM/SIGINT/...: forward, wait the grace period, kill the rest, leave, exit 128+signal

Workers are stopped with SIGKILL on restarts (recovery speed; committed state lives outside the
worker), and with the received signal plus a grace period when the agent itself is told to stop.

This module keeps the loop, the rendezvous calls and the signals.  Its rooms:
:class:`~elastrun.agent.group.WorkerGroup` (the local workers of a round),
:class:`~elastrun.agent.reform_session.ReformSession` (in-process re-forms),
:class:`~elastrun.agent.runtime.NodeRuntime` (directories and services on the node; among them
:class:`~elastrun.agent.snapserver.SnapshotService`, the snapshot server and replicator),
:class:`~elastrun.agent.launches.LaunchBuilder` (what each worker is started with) and
:class:`~elastrun.agent.report.AgentReport` (events and console lines).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import time
import uuid
from pathlib import Path

from elastrun.agent.aftermath import Aftermath, fault_name
from elastrun.agent.console import Console
from elastrun.agent.group import WorkerGroup
from elastrun.agent.group_end import GroupEnd, Outcome
from elastrun.agent.join_gate import defer_join
from elastrun.agent.launches import LaunchBuilder
from elastrun.agent.reform_session import COMMIT_WAIT, Phase, ReformSession
from elastrun.agent.report import AgentReport
from elastrun.agent.runtime import NodeRuntime
from elastrun.agent.snapserver import SnapshotService
from elastrun.agent.workers.control_server import ControlServer
from elastrun.agent.workers.starter import WorkerStarter
from elastrun.config import FORWARDED_SIGNALS, LaunchConfig
from elastrun.rendezvous.api import (
    FailureRecord,
    JobFailedError,
    JobFinishedError,
    NodeInfo,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousTimeoutError,
    RoundChange,
    RoundResult,
)
from elastrun.rendezvous.auth import load_token


class AgentStopped(BaseException):
    """Raised from the signal handler to leave a blocking rendezvous when the agent must stop.

    A ``BaseException``, as ``KeyboardInterrupt`` is: a backend's ``except Exception`` (which turns a
    client error into a lost-rendezvous error) must not catch it, or the agent exits 1, not 128+signal.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def make_node_id() -> str:
    """A readable id, unique per agent process: ``host-pid-xxxx``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def describe_change(change: RoundChange) -> str:
    if change.lost_nodes:
        return f"node(s) lost: {', '.join(change.lost_nodes)}"
    if change.nodes_waiting:
        return f"{change.nodes_waiting} node(s) waiting to join"
    return "another node asked for a new round"


class LocalAgent:
    """Runs one node's share of a job.  ``run()`` returns the agent's exit code.

    Example (what ``elastrun.launcher.run`` does)::

        handler = registry.create_handler(params)
        agent = LocalAgent(config, handler, ExecStarter(), base_env=dict(os.environ))
        exit_code = agent.run()
    """

    def __init__(
        self,
        config: LaunchConfig,
        handler: RendezvousHandler,
        starter: WorkerStarter,
        base_env: dict[str, str] | None = None,
        node_id: str | None = None,
        console: Console | None = None,
    ) -> None:
        self.config = config
        self.handler = handler
        self.starter = starter
        self.node_id = node_id or make_node_id()
        self.hostname = socket.gethostname()
        self.report = AgentReport(config, self.node_id, self.hostname, console)
        self.runtime = NodeRuntime(self.node_id, Path(config.log_dir) if config.log_dir else None)
        channel = ControlServer(self.runtime.socket_path("control.sock")) if config.reform_timeout > 0 else None
        self.session = self.runtime.add(ReformSession(channel, config.reform_timeout))
        self.snapshots = self.runtime.add(SnapshotService(
            self.runtime, self._own_addr(), load_token(config.rdzv_configs.get("token_file")), config.run_id,
            self.node_id, self.report.console.warn))  # fmt: skip
        self.report.snapshot_server(self.snapshots.address, self.snapshots.key is not None)
        self.launches = LaunchBuilder(config, base_env if base_env is not None else os.environ, self.node_id,
                                      self.runtime)
        self.aftermath = Aftermath(self.report, self.node_id, Path(config.log_dir) if config.log_dir else None,
                                   config.verbose)
        self.group = WorkerGroup(config, starter, self.session, self.report, self.node_id, self.hostname,
                                 handler.claim_hang, self.aftermath)
        self.result: RoundResult | None = None
        self._pending_signal: int | None = None
        self._in_rendezvous = False
        #: When the fault that ended the last group was seen (monotonic), and what it was.
        self._fault: tuple[float, str] | None = None

    # ------------------------------------------------------------------ signals, start and end
    def _install_signal_handlers(self) -> dict[int, object]:
        return {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED_SIGNALS}

    def _on_signal(self, signum: int, _frame) -> None:
        if self._pending_signal is None:
            self._pending_signal = signum
        if self._in_rendezvous:
            self._in_rendezvous = False
            raise AgentStopped(signum)

    def _stopped(self, signum: int) -> tuple[int, str]:
        return 128 + signum, f"stopped by {signal.Signals(signum).name}"

    def run(self) -> int:
        """Run until the job ends for this node; returns the exit code (0, 1, or 128+signal)."""
        previous = self._install_signal_handlers()
        from elastrun.observe import start_observability

        observability = start_observability(self.config, self.report.events)
        observability.goodput.add_step_dir(self.runtime.log_dir)  # the workers' step records without --log-dir
        self.report.agent_start(os.getpid())
        code, reason = 1, ""
        try:
            code, reason = self._run()
        except AgentStopped as stop:
            code, reason = self._stopped(stop.signum)
            self.report.signal_in_rendezvous(stop.signum)
            self._leave(reason)
        finally:
            self.group.kill()
            self.aftermath.settle(None)  # what was not judged by now is shown
            try:
                self.handler.close()
            except Exception as exc:
                self.report.detail(f"rendezvous close failed: {exc}")
            self.starter.close()
            # Before the runtime goes: without --log-dir the workers' step records live in its directory.
            self.report.agent_exit(code, reason, observability.goodput.summary_line if self.result else None)
            self.runtime.close()
            observability.close(self.report.events)
            self.report.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
        return code

    def _leave(self, reason: str) -> None:
        try:
            self.handler.leave(reason)
        except RendezvousError as exc:
            self.report.detail(f"could not leave the rendezvous cleanly: {exc}")

    # ------------------------------------------------------------------ the loop
    def _own_addr(self) -> str:
        """The address other nodes reach this agent by."""
        return getattr(self.handler, "local_addr", None) or self.config.local_addr or self.hostname

    def _node_info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            addr=self._own_addr(),
            nproc=self.config.nproc_per_node,
            role=self.config.role,
            hostname=self.hostname,
            pid=os.getpid(),
            fixed_rank=self.config.node_rank if self.config.rdzv_backend == "static" else -1,
        )

    def _run(self) -> tuple[int, str]:
        node = self._node_info()
        while True:
            if self._pending_signal is not None:
                return self._stopped(self._pending_signal)
            try:
                result = self._rendezvous(node)
            except JobFailedError as exc:
                self.aftermath.settle(exc.cause, self.result)
                self.report.job_failed(exc.summary or str(exc), exc.exit_code)
                return exc.exit_code, "job failed"
            except JobFinishedError as exc:
                self.report.job_already_finished(str(exc))
                return 0, "job already finished"
            except RendezvousTimeoutError as exc:
                self.aftermath.settle(None)
                self.report.job_failed(str(exc))
                return 1, "rendezvous timeout"
            except RendezvousConnectionError as exc:
                self.aftermath.settle(None)
                self.report.job_failed(str(exc))
                return 1, "rendezvous lost"
            self.group.start(result, self.launches.for_round(result))
            if self._fault is not None:
                at, why = self._fault
                if result.cause is not None and result.cause.rank is not None:  # every node's records judged it
                    why = fault_name(result.cause, self.node_id)
                self.report.recovered(result, why, time.monotonic() - at, say=self.session.phase is not Phase.ASSIGNED)
                self._fault = None
            end = self._monitor(result)
            if end.outcome is Outcome.SUCCEEDED:
                return self._finish(result)
            if end.outcome is Outcome.SIGNALED:
                assert self._pending_signal is not None
                return 128 + self._pending_signal, end.reason
            if end.outcome is Outcome.ABORTED:
                self.aftermath.settle(None)
                self.report.job_failed(end.reason, end.exit_code)
                return end.exit_code, "job failed"
            if end.outcome is Outcome.FAILED and end.failure is not None:
                self._report_failure(end.failure)
            self._fault = (end.detected_at, end.reason)

    def _rendezvous(self, node: NodeInfo) -> RoundResult:
        self.report.round_start(self.result)
        self._in_rendezvous = True
        try:
            if self._pending_signal is not None:
                raise AgentStopped(self._pending_signal)
            if self.result is None:  # a first join: into a job that trains, this node's start-up comes first
                deferral = defer_join(self.handler.join_interrupts, self.starter.ready_fileno(),
                                      self.report.join_deferred)
                if deferral is not None:
                    self.report.join_resumed(deferral.waited, deferral.ended_by)
            result = self.handler.next_round(node)
        finally:
            self._in_rendezvous = False
        # The workers of the last group whose verdict waited for the round's culprit (another node's, or
        # a lost node): the closer named it from every node's records.
        self.aftermath.settle(result.cause, self.result)
        self.result = result
        self.report.round_closed(result)
        return result

    def _finish(self, result: RoundResult) -> tuple[int, str]:
        """Every local worker succeeded: wait (bounded) at the exit barrier for the other nodes."""
        self.report.local_workers_done(len(self.group.workers), result.group_world_size)
        try:
            self.report.exit_barrier(self.handler.finish(self.config.exit_barrier_timeout))
        except RendezvousError as exc:
            self.report.exit_barrier(False, exc)
        return 0, "succeeded"

    def _monitor(self, result: RoundResult) -> GroupEnd:
        """Watch the group and the rendezvous until the group ends; nothing here sleeps blindly."""
        interval = self.config.monitor_interval
        next_poll = time.monotonic() + interval
        while True:
            if self._pending_signal is not None:
                return self._stop_for_signal(self._pending_signal)
            timeout = max(0.0, next_poll - time.monotonic())
            wake = self.handler.wakeup_fileno()  # readable: the rendezvous has news, poll it now
            fds = self.group.filenos() + self.runtime.filenos() + ([] if wake is None else [wake])
            if fds:
                try:
                    if wake in select.select(fds, [], [], timeout)[0]:
                        next_poll = time.monotonic()
                except InterruptedError:
                    pass
            else:
                time.sleep(timeout)
            self.runtime.pump()
            end = self.group.check(result)
            if end is not None:
                return end
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + interval
                end = self._poll_rendezvous(result)
                if end is not None:
                    return end

    def _poll_rendezvous(self, result: RoundResult) -> GroupEnd | None:
        """Ask the rendezvous whether the job changed: an abort, or a new round wanted elsewhere."""
        try:
            change = self.handler.poll()
        except RendezvousConnectionError as exc:
            self.group.kill()
            return GroupEnd(Outcome.ABORTED, reason=str(exc))
        if change.aborted:
            self.group.kill()
            return GroupEnd(Outcome.ABORTED, reason=change.aborted, exit_code=change.abort_exit_code)
        if not change.restart_needed:
            return None
        detected = time.monotonic()
        reason = describe_change(change)
        self.report.restart(result, reason, change.nodes_waiting)
        # dump=True: a worker that does not answer the pause leaves its stacks in its log before it is killed.
        # A join alone leaves the group whole: its workers may finish their step and leave at its commit.
        within = COMMIT_WAIT if change.nodes_waiting and not change.lost_nodes else 0.0
        self.group.end(set(), detected, dump=True, within=within)
        return GroupEnd(Outcome.MEMBERSHIP, reason=reason, detected_at=detected)

    def _report_failure(self, failure: FailureRecord) -> None:
        try:
            self.handler.report_failure(failure)
        except RendezvousError as exc:
            self.report.failure_not_recorded(exc)

    def _stop_for_signal(self, signum: int) -> GroupEnd:
        self.report.signal_forwarded(signum, self.config.stop_timeout)
        self.group.forward_signal(signum, self.config.stop_timeout)
        _, reason = self._stopped(signum)
        self._leave(reason)
        return GroupEnd(Outcome.SIGNALED, reason=reason)
