"""The node agent: joins rounds, starts and watches the local workers, and reacts to every change.

One agent runs per node.  Its loop::

    while True:
        result = rendezvous.next_round(node)      # blocks until a worker group is formed
        start nproc workers with the round's ranks
        watch them (pidfds, woken the moment one exits) and the rendezvous (every monitor interval)
        on success: exit barrier, exit 0
        on a local failure: kill the local group, record the failure, go round again
        on a change elsewhere (node lost, node waiting, another node's failure): kill, go round again
        (workers of an ``elastrun.train.run`` script are paused instead of killed, and handed the
        next round in their own process: see ``elastrun/agent/reform.py``)
        on a job abort (budget spent): print the root cause, exit 1
        on SIGTERM/SIGINT/...: forward, wait the grace period, kill the rest, leave, exit 128+signal

Workers are stopped with SIGKILL on restarts (recovery speed; committed state lives outside the
worker), and with the received signal plus a grace period when the agent itself is told to stop.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from elastrun.agent.console import Console
from elastrun.agent.hang import HangTracker
from elastrun.agent.launches import worker_environment
from elastrun.agent.reform import Reformer
from elastrun.config import FORWARDED_SIGNALS, LaunchConfig, Std
from elastrun.observe.events import EventLog
from elastrun.protocol import Failed, Reformed
from elastrun.rendezvous.api import (
    FailureRecord,
    JobFailedError,
    JobFinishedError,
    NodeInfo,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousTimeoutError,
    RoundResult,
)
from elastrun.rendezvous.rounds import format_failure
from elastrun.workers.api import ExitStatus, WorkerHandle, WorkerLaunch, WorkerStarter
from elastrun.workers.reports import clear_reports, read_error_file, read_exit_report
from elastrun.workers.spawn import error_file_path


class Outcome(Enum):
    """How one worker group ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    MEMBERSHIP = "membership"
    ABORTED = "aborted"
    SIGNALED = "signaled"


class AgentStopped(BaseException):
    """Raised from the signal handler to leave a blocking rendezvous when the agent must stop.

    A ``BaseException``, as ``KeyboardInterrupt`` is: a backend's ``except Exception`` (which turns a
    client error into a lost-rendezvous error) must not catch it, or the agent exits 1, not 128+signal.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class GroupEnd:
    outcome: Outcome
    failure: FailureRecord | None = None
    reason: str = ""
    detected_at: float = 0.0
    exit_code: int = 1


def sweep_stale_runtime_dirs(base: Path, pattern: str = "elastrun-*") -> None:
    """Remove the agent directories under ``base`` whose owning agent (``owner.pid``) no longer runs."""
    for path in base.glob(pattern):
        owner = path / "owner.pid"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass


def _link_kept_logs(old: WorkerLaunch, new: WorkerLaunch) -> None:
    """Make a kept worker's log files visible in the new attempt's directory as well.

    Its process keeps writing where it started (its streams stay open), so the new attempt's
    ``rank_<r>/stdout.log`` and ``stderr.log`` become relative symlinks to those files: every
    attempt's directory lists every rank, as after a restart.
    """
    for was, now in ((old.stdout_path, new.stdout_path), (old.stderr_path, new.stderr_path)):
        if was is None or now is None or was == now:
            continue
        try:
            now.parent.mkdir(parents=True, exist_ok=True)
            now.unlink(missing_ok=True)
            now.symlink_to(os.path.relpath(was, now.parent))
        except OSError:
            pass  # a log directory that cannot take a link: the worker's output is still in the old file


def make_node_id() -> str:
    """A readable id, unique per agent process: ``host-pid-xxxx``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


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
        self.base_env = dict(base_env if base_env is not None else os.environ)
        self.node_id = node_id or make_node_id()
        self.hostname = socket.gethostname()
        self.console = console or Console(self.node_id, quiet=config.quiet, verbose=config.verbose)
        self.log_dir = Path(config.log_dir) if config.log_dir else None
        sweep_stale_runtime_dirs(Path(tempfile.gettempdir()), "elastrun-agent-*")
        self._tmp_dir = Path(tempfile.mkdtemp(prefix="elastrun-agent-"))
        (self._tmp_dir / "owner.pid").write_text(str(os.getpid()))
        self.error_dir = self.log_dir if self.log_dir is not None else self._tmp_dir
        self.runtime_dir = self._make_runtime_dir()
        self.snapshot_dir = self.runtime_dir / "snapshot"
        self.heartbeat_dir = self.runtime_dir / "heartbeat"
        self.snapshot_dir.mkdir()
        self.heartbeat_dir.mkdir()
        self.reformer = Reformer(self.runtime_dir, self._tmp_dir, config.reform_timeout)
        self.trackers: dict[int, HangTracker] = {}
        #: Exit codes reported by the scripts of the current workers that have returned (by local rank).
        self._exit_reports: dict[int, tuple[int, float]] = {}
        events_path = self.log_dir / f"events-{self.node_id}.jsonl" if self.log_dir else None
        self.events = EventLog(self.node_id, events_path, sys.stdout if config.event_log_stdout else None)
        self.workers: list[WorkerHandle] = []
        self.result: RoundResult | None = None
        self._pending_signal: int | None = None
        self._in_rendezvous = False
        self._fault_at: float | None = None
        self._fault_reason = ""
        self._prev_world: int | None = None

    # ------------------------------------------------------------------ set-up and tear-down
    def _make_runtime_dir(self) -> Path:
        """This agent's node-local memory (``/dev/shm``): workers' snapshots and heartbeats.

        It outlives worker restarts and is removed when the agent exits.  An agent that was
        SIGKILLed cannot remove its own, so each agent first sweeps the directories of agents
        that are no longer running (their ``owner.pid`` names a dead process).
        """
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self._tmp_dir
        sweep_stale_runtime_dirs(base)
        path = base / f"elastrun-{self.node_id}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "owner.pid").write_text(str(os.getpid()))
        return path

    def _install_signal_handlers(self) -> dict[int, object]:
        previous = {}
        for sig in FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _on_signal(self, signum: int, _frame) -> None:
        if self._pending_signal is None:
            self._pending_signal = signum
        if self._in_rendezvous:
            self._in_rendezvous = False
            raise AgentStopped(signum)

    def run(self) -> int:
        """Run until the job ends for this node; returns the exit code (0, 1, or 128+signal)."""
        previous = self._install_signal_handlers()
        from elastrun.observe import start_observability

        observability = start_observability(self.config, self.events)
        self.events.emit(
            "agent_start",
            run_id=self.config.run_id,
            backend=self.config.rdzv_backend,
            min_nodes=self.config.min_nodes,
            max_nodes=self.config.max_nodes,
            nproc=self.config.nproc_per_node,
            pid=os.getpid(),
            hostname=self.hostname,
        )
        code = 1
        reason = ""
        try:
            code, reason = self._run()
        except AgentStopped as stop:
            code, reason = 128 + stop.signum, f"stopped by {signal.Signals(stop.signum).name}"
            self.events.emit("signal", signal=signal.Signals(stop.signum).name, action="left during rendezvous")
            self._leave(reason)
        finally:
            self._kill_workers()
            self.reformer.close()
            try:
                self.handler.close()
            except Exception as exc:
                self.console.debug(f"rendezvous close failed: {exc}")
            self.starter.close()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self.events.emit("agent_exit", exitcode=code, reason=reason)
            observability.close(self.events)
            self.events.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
        return code

    def _leave(self, reason: str) -> None:
        try:
            self.handler.leave(reason)
        except RendezvousError as exc:
            self.console.debug(f"could not leave the rendezvous cleanly: {exc}")

    # ------------------------------------------------------------------ main loop
    def _node_info(self) -> NodeInfo:
        addr = getattr(self.handler, "local_addr", None) or self.config.local_addr or self.hostname
        return NodeInfo(
            node_id=self.node_id,
            addr=addr,
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
                return 128 + self._pending_signal, f"stopped by {signal.Signals(self._pending_signal).name}"
            try:
                result = self._rendezvous(node)
            except JobFailedError as exc:
                self.console.error(exc.summary or str(exc))
                self.events.emit("job_failed", reason=exc.summary or str(exc), exitcode=exc.exit_code)
                return exc.exit_code, "job failed"
            except JobFinishedError as exc:
                self.console.info(str(exc))
                return 0, "job already finished"
            except RendezvousTimeoutError as exc:
                self.console.error(str(exc))
                self.events.emit("job_failed", reason=str(exc))
                return 1, "rendezvous timeout"
            except RendezvousConnectionError as exc:
                self.console.error(str(exc))
                self.events.emit("job_failed", reason=str(exc))
                return 1, "rendezvous lost"
            self._start_workers(result)
            end = self._monitor(result)
            if end.outcome is Outcome.SUCCEEDED:
                if result.group_world_size > 1:
                    self.console.info(f"all {len(self.workers)} local worker(s) finished; waiting for the other nodes")
                try:
                    all_done = self.handler.finish(self.config.exit_barrier_timeout)
                except RendezvousError as exc:
                    self.console.warn(f"exit barrier skipped: {exc}")
                    all_done = False
                if not all_done:
                    self.console.info("not every node finished with this one; this node's work is done")
                return 0, "succeeded"
            if end.outcome is Outcome.SIGNALED:
                assert self._pending_signal is not None
                return 128 + self._pending_signal, end.reason
            if end.outcome is Outcome.ABORTED:
                self.console.error(end.reason)
                self.events.emit("job_failed", reason=end.reason, exitcode=end.exit_code)
                return end.exit_code, "job failed"
            if end.outcome is Outcome.FAILED and end.failure is not None:
                self._report_failure(end.failure)
            self._fault_at = end.detected_at
            self._fault_reason = end.reason

    def _rendezvous(self, node: NodeInfo) -> RoundResult:
        self.events.emit("round_start", after=self.result.round if self.result else None)
        self._in_rendezvous = True
        try:
            if self._pending_signal is not None:
                raise AgentStopped(self._pending_signal)
            result = self.handler.next_round(node)
        finally:
            self._in_rendezvous = False
        self.result = result
        ordered = sorted(result.members, key=lambda m: m.group_rank)
        members = [f"{m.node_id} ({m.addr}) #{m.group_rank}" for m in ordered]
        self.events.emit(
            "round_closed",
            round=result.round,
            generation=result.generation,
            group_rank=result.group_rank,
            group_world_size=result.group_world_size,
            world_size=result.world_size,
            members=[m.node_id for m in result.members],
            duration=round(result.duration, 4),
            restarts_used=result.restarts_used,
            max_restarts=result.max_restarts,
        )
        if self._prev_world is not None and self._prev_world != result.world_size:
            self.events.emit("scale_change", old_world_size=self._prev_world, new_world_size=result.world_size)
        self._prev_world = result.world_size
        if result.lost_nodes:
            self.events.emit("node_lost", round=result.round, lost=result.lost_nodes, causes=result.lost_causes)
        lost = f"; node(s) lost since the last round: {', '.join(result.lost_nodes)}" if result.lost_nodes else ""
        self.console.info(
            f"round {result.round} formed in {result.duration:.2f} s: {result.group_world_size} node(s), "
            f"world size {result.world_size}, this node is group rank {result.group_rank} "
            f"(ranks {result.rank_offset}-{result.rank_offset + self.config.nproc_per_node - 1}); "
            f"restarts used {result.restarts_used}/{result.max_restarts}{lost}",
            detail=", ".join(members),
        )
        return result

    # ------------------------------------------------------------------ workers
    def _streams_for(self, local_rank: int) -> tuple[Std, Std]:
        def pick(mapping: dict[int, Std]) -> Std:
            return mapping.get(local_rank, mapping.get(-1, Std.NONE))

        return pick(self.config.redirects), pick(self.config.tee)

    def _launch_for(self, result: RoundResult, local_rank: int) -> WorkerLaunch:
        rank = result.rank_offset + local_rank
        error_file = error_file_path(self.error_dir, result.generation, rank)
        error_file.parent.mkdir(parents=True, exist_ok=True)
        if error_file.exists():
            error_file.unlink()
        env = worker_environment(
            self.base_env,
            result=result,
            local_rank=local_rank,
            nproc=self.config.nproc_per_node,
            role=self.config.role,
            run_id=self.config.run_id,
            max_restarts=self.config.max_restarts,
            node_id=self.node_id,
            error_file=str(error_file),
            snapshot_dir=str(self.snapshot_dir),
            extra={"ELASTRUN_HEARTBEAT_FILE": str(self.heartbeat_dir / f"rank_{rank}"), **self.reformer.env()},
        )
        env.setdefault("PYTHONFAULTHANDLER", "1")
        redirect, tee = self._streams_for(local_rank)
        files = redirect | tee
        log_base = (self.log_dir or self._tmp_dir) / f"attempt_{result.generation}" / f"rank_{rank}"
        shown = self.config.local_ranks_filter is None or local_rank in self.config.local_ranks_filter
        return WorkerLaunch(
            local_rank=local_rank,
            rank=rank,
            argv=self.config.worker_argv(sys.executable),
            env=env,
            cwd=os.getcwd(),
            stdout_path=log_base / "stdout.log" if files & Std.OUT else None,
            stderr_path=log_base / "stderr.log" if files & Std.ERR else None,
            tee_stdout=bool(tee & Std.OUT),
            tee_stderr=bool(tee & Std.ERR),
            console_prefix=f"[node{result.group_rank} rank{rank}]: ",
            show_on_console=shown,
            error_file=error_file,
            python_target=None if self.config.no_python else self.config.entrypoint,
            python_module=self.config.module,
            python_args=list(self.config.args),
        )

    def _start_workers(self, result: RoundResult) -> None:
        kept, self.reformer.kept = self.reformer.kept, {}
        self.workers = []
        self.trackers = {}
        self._exit_reports = {}
        for local_rank in range(self.config.nproc_per_node):
            launch = self._launch_for(result, local_rank)
            hb_path = launch.env["ELASTRUN_HEARTBEAT_FILE"]
            clear_reports(hb_path)
            self.trackers[local_rank] = HangTracker(hb_path, self.config.hang_timeout, self.config.startup_timeout)
            handle = kept.pop(local_rank, None)
            if handle is not None and not self._reassign(handle, launch, result):
                self._discard(handle)
                handle = None
            method = "kept"
            if handle is None:
                handle = self.starter.start(launch)
                method = handle.start_method or self.starter.name
                if self.reformer.pending is not None:
                    self.reformer.pending.restarted.append(local_rank)
            self.workers.append(handle)
            self.events.emit(
                "worker_start",
                round=result.round,
                generation=result.generation,
                rank=launch.rank,
                local_rank=local_rank,
                pid=handle.pid,
                start_method=method,
            )
        for handle in kept.values():  # local ranks the new round does not have
            self._discard(handle)
        if self.reformer.pending is not None:
            self.reformer.pending.round = result.round
            if not self.reformer.pending.kept:
                self.reformer.pending = None
        if self._fault_at is not None:
            took = time.monotonic() - self._fault_at
            self.events.emit("recovered", round=result.round, reason=self._fault_reason, duration=round(took, 4))
            self.console.info(f"workers running again {took:.2f} s after {self._fault_reason}")
            self._fault_at = None

    def _reassign(self, handle: WorkerHandle, launch: WorkerLaunch, result: RoundResult) -> bool:
        """Hand a paused worker the new round (it keeps its process, error file and log files)."""
        old = handle.launch
        env = dict(launch.env)
        env["TORCHELASTIC_ERROR_FILE"] = old.env.get("TORCHELASTIC_ERROR_FILE", env["TORCHELASTIC_ERROR_FILE"])
        new = replace(launch, env=env, error_file=old.error_file, stdout_path=old.stdout_path,
                      stderr_path=old.stderr_path)
        if not self.reformer.assign(handle, env, result.round):
            return False
        handle.launch = new
        _link_kept_logs(old, launch)
        handle.set_console_prefix(new.console_prefix)
        pending = self.reformer.pending
        if pending is not None:
            pending.kept[new.local_rank] = handle.pid
        return True

    def _discard(self, handle: WorkerHandle) -> None:
        """Kill and reap one worker."""
        self.reformer.forget(handle)
        if handle.poll() is None:
            handle.send_signal(signal.SIGKILL)
        handle.wait(5.0)
        handle.close()

    def _pause_or_kill(self, doomed: set[int], dump: bool = False) -> list[WorkerHandle]:
        """End the current group: kill the workers of ``doomed`` local ranks and every worker that
        cannot re-form in process; pause the others (kept for the next round, returned).

        ``dump``: a worker that was asked to leave and did not is sent SIGABRT first (its Python
        stacks go to its stderr), as a hung worker is.
        """
        for handle in self.workers:
            if handle.launch.local_rank in doomed and handle.poll() is None:
                handle.send_signal(signal.SIGKILL)
        candidates = [h for h in self.workers if h.launch.local_rank not in doomed]
        kept, asked = self.reformer.pause(candidates, self._fault_at or time.monotonic())
        stuck = [h for h in asked if h not in kept and h.poll() is None]
        if dump and stuck:
            for handle in stuck:
                handle.send_signal(signal.SIGABRT)
                handle.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 3.0
            for handle in stuck:
                handle.wait(max(0.0, deadline - time.monotonic()))
        for handle in self.workers:
            if handle not in kept:
                self._discard(handle)
        if kept:
            ranks = sorted(h.launch.rank for h in kept)
            took = self.reformer.pending.paused_in if self.reformer.pending else 0.0
            self.console.info(f"rank(s) {', '.join(map(str, ranks))} left their group in {took:.2f} s "
                              "and keep their process for the next round")
        return kept

    def _watch_reforms(self, result: RoundResult) -> None:
        """Read kept workers' reports; once all re-formed, emit the ``reform`` event."""
        pending = self.reformer.pending
        if pending is None:
            return
        for handle in self.workers:
            local_rank = handle.launch.local_rank
            if local_rank not in pending.kept:
                continue
            failed = self.reformer.take(handle, Failed)
            if isinstance(failed, Failed):
                self.console.warn(f"rank {handle.launch.rank} could not re-form: {failed.error[-300:]}")
            done = self.reformer.take(handle, Reformed)
            if isinstance(done, Reformed):
                pending.reformed[local_rank] = done
        if len(pending.reformed) < len(pending.kept):
            return
        took = time.monotonic() - pending.detected_at
        sources = sorted({str(r.source) for r in pending.reformed.values()})
        self.events.emit("reform", round=result.round, duration=round(took, 4), paused_in=round(pending.paused_in, 4),
                         kept=sorted(pending.kept), restarted=sorted(pending.restarted), sources=sources,
                         step=max((r.step or 0) for r in pending.reformed.values()))
        self.console.info(f"re-formed in process {took:.2f} s after the change: local rank(s) "
                          f"{', '.join(map(str, sorted(pending.kept)))} kept their process"
                          + (f", {', '.join(map(str, sorted(pending.restarted)))} restarted" if pending.restarted
                             else "") + f" (state: {', '.join(sources)})")
        self.reformer.pending = None

    def _monitor(self, result: RoundResult) -> GroupEnd:
        interval = self.config.monitor_interval
        statuses: dict[int, ExitStatus] = {}
        next_poll = time.monotonic() + interval
        while True:
            if self._pending_signal is not None:
                return self._stop_for_signal(self._pending_signal)
            running = [h for h in self.workers if h.launch.local_rank not in statuses]
            timeout = max(0.0, next_poll - time.monotonic())
            wake = self.handler.wakeup_fileno()  # readable: the rendezvous has news, poll it now
            fds = [h.fileno() for h in running] + self.reformer.filenos() + ([] if wake is None else [wake])
            if fds:
                try:
                    if wake in select.select(fds, [], [], timeout)[0]:
                        next_poll = time.monotonic()
                except InterruptedError:
                    pass
            else:
                time.sleep(timeout)
            self.reformer.pump()
            self._watch_reforms(result)
            for handle in running:
                status = handle.poll()
                if status is None:
                    status = self._teardown_overdue(handle)
                if status is not None:
                    status = self._judge_exit(result, handle, status)
                    statuses[handle.launch.local_rank] = status
                    self._worker_exited(result, handle, status)
            failed = [(h, statuses[h.launch.local_rank]) for h in self.workers
                      if h.launch.local_rank in statuses and not statuses[h.launch.local_rank].succeeded]
            if failed:
                detected = time.monotonic()
                self._fault_at = detected
                self._pause_or_kill({h.launch.local_rank for h, _ in failed})
                failure = self._failure_record(result, failed)
                how = f"killed by {failure.signal}" if failure.signal else f"exit code {failure.exitcode}"
                last = [line.strip() for line in failure.message.splitlines() if line.strip()]
                cause = f": {last[-1].split(']: ', 1)[-1][:200]}" if last else ""
                self.console.error(
                    f"rank {failure.rank} on {self.hostname} failed ({how}){cause}; starting a new round"
                )
                return GroupEnd(Outcome.FAILED, failure, f"the failure of rank {failure.rank}", detected)
            if len(statuses) == len(self.workers):
                return GroupEnd(Outcome.SUCCEEDED)
            hung = self._find_hang(statuses)
            if hung is not None:
                return self._end_for_hang(result, *hung)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + interval
                try:
                    change = self.handler.poll()
                except RendezvousConnectionError as exc:
                    self._kill_workers()
                    return GroupEnd(Outcome.ABORTED, reason=str(exc))
                if change.aborted:
                    self._kill_workers()
                    return GroupEnd(Outcome.ABORTED, reason=change.aborted, exit_code=change.abort_exit_code)
                if change.restart_needed:
                    detected = time.monotonic()
                    self._fault_at = detected
                    reason = self._describe_change(change)
                    self.console.info(f"{reason}: stopping the local workers for a new round")
                    if change.nodes_waiting:
                        self.events.emit("nodes_waiting", round=result.round, count=change.nodes_waiting)
                    self.events.emit("restart", round=result.round, reason=reason,
                                     restarts_used=result.restarts_used, max_restarts=result.max_restarts)
                    self._pause_or_kill(set())
                    return GroupEnd(Outcome.MEMBERSHIP, reason=reason, detected_at=detected)

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
        code = report[0]
        after = time.time() - report[1]
        rank = handle.launch.rank
        self.console.warn(
            f"rank {rank} {status.describe()} {after:.1f} s after its script returned with exit code {code}: "
            f"a fault in interpreter teardown, not a failure; keeping exit code {code}"
        )
        self.events.emit("teardown_fault", round=result.round, rank=rank, local_rank=handle.launch.local_rank,
                         exitcode=code, fault=status.describe(), after=round(after, 3))
        return ExitStatus(exitcode=code, signal=None, timestamp=status.timestamp)

    def _find_hang(self, statuses: dict[int, ExitStatus]) -> tuple[WorkerHandle, str] | None:
        now = time.time()
        for handle in self.workers:
            if handle.launch.local_rank in statuses or self._exit_report(handle) is not None:
                continue
            tracker = self.trackers[handle.launch.local_rank]
            reason = tracker.check(now)
            first_beat = tracker.take_first_beat()
            if first_beat is not None and self.result is not None:
                self.events.emit("worker_stepping", round=self.result.round, generation=self.result.generation,
                                 rank=handle.launch.rank, local_rank=handle.launch.local_rank, pid=handle.pid,
                                 first_heartbeat=round(first_beat, 4),
                                 since_start=round(first_beat - tracker.started, 4))
            if reason is not None:
                return handle, reason
        return None

    def _end_for_hang(self, result: RoundResult, handle: WorkerHandle, reason: str) -> GroupEnd:
        """Dump the hung worker's Python stacks (faulthandler on SIGABRT), kill the group, record it."""
        detected = time.monotonic()
        self._fault_at = detected
        rank = handle.launch.rank
        self.events.emit("hang_detected", round=result.round, rank=rank, local_rank=handle.launch.local_rank,
                         reason=reason)
        self.reformer.pump()
        if self.reformer.opted_in(handle):
            # A worker blocked in a collective on a stopped or dead peer looks hung too: every worker
            # is asked to leave its group; the ones that cannot are the hung ones (dumped, restarted).
            self.console.error(f"rank {rank} is hung: {reason}; asking the workers to leave their group "
                               "(a worker that cannot is dumped to its stderr and restarted)")
            kept = self._pause_or_kill(set(), dump=True)
            status = handle.poll() or (ExitStatus(exitcode=None, signal=None, timestamp=time.time()) if handle in kept
                                       else ExitStatus(exitcode=None, signal=signal.SIGKILL, timestamp=time.time()))
        else:
            self.console.error(f"rank {rank} is hung: {reason}; dumping its stack to its stderr and restarting")
            handle.send_signal(signal.SIGABRT)
            handle.send_signal(signal.SIGCONT)
            status = handle.wait(3.0) or ExitStatus(exitcode=None, signal=signal.SIGKILL, timestamp=time.time())
            self._pause_or_kill({handle.launch.local_rank})
        failure = self._failure_record(result, [(handle, status)])
        failure.message = f"hang detected: {reason}\n{failure.message}"
        return GroupEnd(Outcome.FAILED, failure, f"the hang of rank {rank}", detected)

    @staticmethod
    def _describe_change(change) -> str:
        if change.lost_nodes:
            return f"node(s) lost: {', '.join(change.lost_nodes)}"
        if change.nodes_waiting:
            return f"{change.nodes_waiting} node(s) waiting to join"
        return "another node asked for a new round"

    def _worker_exited(self, result: RoundResult, handle: WorkerHandle, status: ExitStatus) -> None:
        self.events.emit(
            "worker_exit",
            round=result.round,
            generation=result.generation,
            rank=handle.launch.rank,
            local_rank=handle.launch.local_rank,
            pid=handle.pid,
            exitcode=status.exitcode,
            signal=status.signal_name,
        )

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
            records.append(
                FailureRecord(
                    node_id=self.node_id,
                    hostname=self.hostname,
                    rank=handle.launch.rank,
                    local_rank=handle.launch.local_rank,
                    exitcode=status.exitcode,
                    signal=status.signal_name,
                    timestamp=status.timestamp,
                    message=message[-8000:],
                )
            )
        first = min(records, key=lambda r: (r.timestamp, r.rank))
        first.progress = any(t.made_progress() for t in self.trackers.values())
        self.events.emit(
            "worker_failure",
            round=result.round,
            generation=result.generation,
            rank=first.rank,
            local_rank=first.local_rank,
            exitcode=first.exitcode,
            signal=first.signal,
            message=first.message[-2000:],
        )
        if self.config.verbose:
            self.console.error(format_failure(first))
        return first

    def _report_failure(self, failure: FailureRecord) -> None:
        try:
            self.handler.report_failure(failure)
        except RendezvousError as exc:
            self.console.warn(f"could not record the failure in the rendezvous: {exc}")

    def _stop_for_signal(self, signum: int) -> GroupEnd:
        name = signal.Signals(signum).name
        grace = self.config.stop_timeout
        self.console.info(f"received {name}: forwarding it to the workers, {grace:g} s before SIGKILL")
        self.events.emit("signal", signal=name, action="forward", grace=grace)
        for handle in self.workers:
            handle.send_signal(signum)
        deadline = time.monotonic() + grace
        for handle in self.workers:
            handle.wait(max(0.0, deadline - time.monotonic()))
        self._kill_workers()
        self._leave(f"stopped by {name}")
        return GroupEnd(Outcome.SIGNALED, reason=f"stopped by {name}")

    def _kill_workers(self) -> None:
        """SIGKILL every worker's process group and reap them."""
        for handle in self.workers:
            if handle.poll() is None:
                handle.send_signal(signal.SIGKILL)
        for handle in self.workers:
            handle.wait(5.0)
            handle.close()
