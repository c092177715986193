"""What an agent tells: each event of its log together with its console line, in one named method.

The event log (``events-<node>.jsonl``, :mod:`elastrun.observe.events`) is read back by
``elastrun timeline``, the metrics and the tests; the console lines are for the person watching.
Both say the same things, so each happening has one method here that writes both, and the agent's
code reads as what happens (``report.recovered(...)``), not as how it is written down.

The last method the agent calls is :meth:`AgentReport.agent_exit`: the place for an end-of-job
summary computed from the events (a listener on :attr:`AgentReport.events` sees every one).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastrun.agent.console import Console
from elastrun.agent.workers.starter import ExitStatus, WorkerHandle, WorkerLaunch
from elastrun.config import LaunchConfig
from elastrun.observe.events import EventLog
from elastrun.rendezvous.api import FailureRecord, RoundResult
from elastrun.rendezvous.rounds import format_failure


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


class AgentReport:
    """The agent's event log and console, one method per happening."""

    def __init__(self, config: LaunchConfig, node_id: str, hostname: str, console: Console | None = None) -> None:
        self.config = config
        self.node_id = node_id
        self.hostname = hostname
        self.console = console or Console(node_id, quiet=config.quiet, verbose=config.verbose)
        log_dir = Path(config.log_dir) if config.log_dir else None
        path = log_dir / f"events-{node_id}.jsonl" if log_dir else None
        self.events = EventLog(node_id, path, sys.stdout if config.event_log_stdout else None)
        self._world: int | None = None  # the last round's world size, for scale_change

    # -- the agent's life ------------------------------------------------------------------------
    def agent_start(self, pid: int) -> None:
        c = self.config
        self.events.emit("agent_start", run_id=c.run_id, backend=c.rdzv_backend, min_nodes=c.min_nodes,
                         max_nodes=c.max_nodes, nproc=c.nproc_per_node, pid=pid, hostname=self.hostname)

    def agent_exit(self, code: int, reason: str, goodput: Callable[[], str] | None = None) -> None:
        """The agent's last word: its exit code and why, then this node's goodput line (once workers ran).

        ``goodput`` computes the line from the events, so it is called after ``agent_exit`` is logged:
        computed before, the node would still look running, and the line would be a figure "so far"
        (the script's end counted as a step in progress) that ``elastrun goodput`` does not give.
        """
        self.events.emit("agent_exit", exitcode=code, reason=reason)
        if goodput is not None:
            self.console.info(goodput())

    def snapshot_server(self, address: str | None, auth: bool) -> None:
        """The node's snapshot server listens (None: it could not start, and said why)."""
        if address is None:
            return
        self.events.emit("snapshot_server", address=address, auth=auth)
        self.console.debug(f"snapshot server on {address} ({'job token required' if auth else 'no job token'})")

    def close(self) -> None:
        self.events.close()

    def detail(self, message: str) -> None:
        """A line for ``--verbose`` only (e.g. a clean-up step that failed harmlessly)."""
        self.console.debug(message)

    # -- rounds ----------------------------------------------------------------------------------
    def round_start(self, after: RoundResult | None) -> None:
        self.events.emit("round_start", after=after.round if after else None)

    def join_deferred(self) -> None:
        """A first join waits for this node's start-up: the job trains, and joining stops its group."""
        self.events.emit("join_deferred")
        self.console.info("the job is training: this node joins once its workers can start (its imports are "
                          "still running), so that the running workers do not stand still meanwhile")

    def join_resumed(self, waited: float, ended_by: str) -> None:
        """The deferred join goes ahead (``ended_by``: ready, round forming, limit, rendezvous error)."""
        self.events.emit("join_resumed", waited=round(waited, 4), ended_by=ended_by)
        self.console.debug(f"joining after {waited:.2f} s of start-up ({ended_by})")

    def round_closed(self, result: RoundResult) -> None:
        """The round formed: its event, a scale change and lost nodes if any, and its console line."""
        nproc = self.config.nproc_per_node
        self.events.emit("round_closed", round=result.round, generation=result.generation,
                         group_rank=result.group_rank, group_world_size=result.group_world_size,
                         world_size=result.world_size, members=[m.node_id for m in result.members],
                         duration=round(result.duration, 4), restarts_used=result.restarts_used,
                         max_restarts=result.max_restarts)
        if self._world is not None and self._world != result.world_size:
            self.events.emit("scale_change", old_world_size=self._world, new_world_size=result.world_size)
        self._world = result.world_size
        if result.lost_nodes:
            self.events.emit("node_lost", round=result.round, lost=result.lost_nodes, causes=result.lost_causes)
        lost = f"; node(s) lost since the last round: {', '.join(result.lost_nodes)}" if result.lost_nodes else ""
        ordered = sorted(result.members, key=lambda m: m.group_rank)
        members = [f"{m.node_id} ({m.addr}) #{m.group_rank}" for m in ordered]
        cause = result.cause
        after = ""
        if cause is not None and cause.rank is not None and cause.node_id != self.node_id:  # another node's culprit
            after = f" after the failure of rank {cause.rank} on {cause.hostname or cause.node_id} ({cause.what})"
        self.console.info(
            f"round {result.round} formed in {result.duration:.2f} s{after}: {result.group_world_size} node(s), "
            f"world size {result.world_size}, this node is group rank {result.group_rank} "
            f"(ranks {result.rank_offset}-{result.rank_offset + nproc - 1}); "
            f"restarts used {result.restarts_used}/{result.max_restarts}{lost}",
            detail=", ".join(members),
        )

    def restart(self, result: RoundResult, reason: str, nodes_waiting: int) -> None:
        """A change elsewhere (lost or waiting nodes, another node's failure) ends this group."""
        self.console.info(f"{reason}: stopping the local workers for a new round")
        if nodes_waiting:
            self.events.emit("nodes_waiting", round=result.round, count=nodes_waiting)
        self.events.emit("restart", round=result.round, reason=reason, restarts_used=result.restarts_used,
                         max_restarts=result.max_restarts)

    def recovered(self, result: RoundResult, reason: str, took: float, say: bool = True) -> None:
        """The new group's workers are started (``say`` False: kept workers are re-forming, and their
        :meth:`reform` line gives the recovery that counts, when they have rolled back)."""
        self.events.emit("recovered", round=result.round, reason=reason, duration=round(took, 4))
        if say:
            self.console.info(f"workers running again {took:.2f} s after {reason}")

    def rendezvous_warning(self, message: str, fields: dict[str, Any]) -> None:
        """The rendezvous saw something wrong but harmless (e.g. a forged value); its ``on_warning``."""
        self.console.warn(message)
        self.events.emit("rendezvous_warning", message=message, **fields)

    def failure_not_recorded(self, error: Exception) -> None:
        self.console.warn(f"could not record the failure in the rendezvous: {error}")

    # -- the end of a job ------------------------------------------------------------------------
    def job_failed(self, reason: str, exitcode: int | None = None) -> None:
        """The job cannot go on (restarts spent, rendezvous lost or timed out)."""
        self.console.error(reason)
        if exitcode is None:
            self.events.emit("job_failed", reason=reason)
        else:
            self.events.emit("job_failed", reason=reason, exitcode=exitcode)

    def job_already_finished(self, message: str) -> None:
        self.console.info(message)

    def local_workers_done(self, count: int, world: int) -> None:
        if world > 1:
            self.console.info(f"all {count} local worker(s) finished; waiting for the other nodes")

    def exit_barrier(self, all_done: bool, error: Exception | None = None) -> None:
        if error is not None:
            self.console.warn(f"exit barrier skipped: {error}")
        if not all_done:
            self.console.info("not every node finished with this one; this node's work is done")

    # -- signals ---------------------------------------------------------------------------------
    def signal_forwarded(self, signum: int, grace: float) -> None:
        name = signal.Signals(signum).name
        self.console.info(f"received {name}: forwarding it to the workers, {grace:g} s before SIGKILL")
        self.events.emit("signal", signal=name, action="forward", grace=grace)

    def signal_in_rendezvous(self, signum: int) -> None:
        self.events.emit("signal", signal=signal.Signals(signum).name, action="left during rendezvous")

    # -- workers ---------------------------------------------------------------------------------
    def worker_start(self, result: RoundResult, launch: WorkerLaunch, pid: int, method: str) -> None:
        self.events.emit("worker_start", round=result.round, generation=result.generation, rank=launch.rank,
                         local_rank=launch.local_rank, pid=pid, start_method=method)

    def worker_stepping(self, result: RoundResult, handle: WorkerHandle, first_beat: float, started: float) -> None:
        """A worker's first heartbeat: the moment a (re)started worker steps again."""
        self.events.emit("worker_stepping", round=result.round, generation=result.generation,
                         rank=handle.launch.rank, local_rank=handle.launch.local_rank, pid=handle.pid,
                         first_heartbeat=round(first_beat, 4), since_start=round(first_beat - started, 4))

    def worker_exit(self, result: RoundResult, handle: WorkerHandle, status: ExitStatus,
                    alive_at: float | None = None) -> None:
        """A worker's process ended; ``alive_at``: when this agent last saw it running (the death came later,
        so goodput can tell the agent's own lateness, e.g. on a loaded host, from the work the fault cut short)."""
        self.events.emit("worker_exit", round=result.round, generation=result.generation, rank=handle.launch.rank,
                         local_rank=handle.launch.local_rank, pid=handle.pid, exitcode=status.exitcode,
                         signal=status.signal_name, alive_at=None if alive_at is None else round(alive_at, 4))

    def teardown_fault(self, result: RoundResult, handle: WorkerHandle, status: ExitStatus, code: int,
                       after: float) -> None:
        """A worker died in interpreter teardown after its script returned ``code``: not a failure."""
        rank = handle.launch.rank
        self.console.warn(
            f"rank {rank} {status.describe()} {after:.1f} s after its script returned with exit code {code}: "
            f"a fault in interpreter teardown, not a failure; keeping exit code {code}"
        )
        self.events.emit("teardown_fault", round=result.round, rank=rank, local_rank=handle.launch.local_rank,
                         exitcode=code, fault=status.describe(), after=round(after, 3))

    def worker_failure(self, result: RoundResult, first: FailureRecord) -> None:
        """The failure this node records for the round (the earliest of its failed workers)."""
        self.events.emit("worker_failure", round=result.round, generation=result.generation, rank=first.rank,
                         local_rank=first.local_rank, exitcode=first.exitcode, signal=first.signal,
                         message=first.message[-2000:], peer_error=first.peer_error)
        if self.config.verbose:
            self.console.error(format_failure(first))

    def worker_failed(self, failure: FailureRecord) -> None:
        """The console line of a worker that exited with a failure: a new round follows."""
        how = f"killed by {failure.signal}" if failure.signal else f"exit code {failure.exitcode}"
        last = [line.strip() for line in failure.message.splitlines() if line.strip()]
        cause = f": {last[-1].split(']: ', 1)[-1][:200]}" if last else ""
        self.console.error(f"rank {failure.rank} on {self.hostname} failed ({how}){cause}; starting a new round")

    def worker_stopped(self, rank: int, because: str, kept: str | None, error: str) -> None:
        """The one console line of a worker that failed, or was stopped, as a consequence of another
        fault (docs/failures.md); ``kept``: where its traceback stays, ``error``: what it raised."""
        if kept is not None:
            where = f" (its traceback: {kept})"
        elif error:
            where = f" (its error: {error}; --log-dir keeps its traceback)"
        else:
            where = ""
        self.console.info(f"rank {rank} stopped: {because}{where}")

    def hang_detected(self, result: RoundResult, handle: WorkerHandle, reason: str) -> None:
        """A worker's heartbeats stopped and its hang is the round's first fault: it is dumped and killed."""
        rank = handle.launch.rank
        self.events.emit("hang_detected", round=result.round, rank=rank, local_rank=handle.launch.local_rank,
                         reason=reason)
        self.console.error(f"rank {rank} is hung: {reason}; dumping its stack to its stderr and restarting it")

    def hang_elsewhere(self, result: RoundResult, handle: WorkerHandle, reason: str, first: str) -> None:
        """A worker's heartbeats stopped, but another fault of the round came first: it waits on that one."""
        why = f"rank {handle.launch.rank} waits on {first}"
        self.console.warn(f"rank {handle.launch.rank} made no progress ({reason}), behind {first}: "
                          "stopping the local workers for a new round")
        self.events.emit("restart", round=result.round, reason=why, restarts_used=result.restarts_used,
                         max_restarts=result.max_restarts)

    def stall(self, result: RoundResult, reason: str, states: list[Any], dumped: list[int]) -> None:
        """A hang or a stall was judged: what every local worker was doing (``states``, each an
        :class:`elastrun.agent.stall.WorkerState`), before anything is paused or killed; ``dumped``:
        the ranks asked for their stacks (written to their stderr)."""
        self.events.emit("stall", round=result.round, generation=result.generation, reason=reason,
                         workers=[w.as_event() for w in states], stacks=dumped)
        self.console.warn(f"round {result.round}: {reason}; the local workers, before anything is stopped:")
        for w in states:
            self.console.warn(f"  {w.line()}")
        if dumped:
            self.console.warn(f"  Python stacks of rank(s) {_ranks(dumped)} written to their stderr")
        if reason.startswith("no first heartbeat") and self.config.crash_loop_limit:
            self.console.warn(f"  an attempt whose workers never stepped makes no progress: it counts toward "
                              f"--crash-loop-limit={self.config.crash_loop_limit}")

    # -- in-process re-forms ---------------------------------------------------------------------
    def workers_paused(self, kept: list[tuple[int, int]], took: float, at_commit: bool = False) -> None:
        """Workers that left their group and keep their process: ``kept`` holds (rank, pid) pairs;
        ``at_commit``: they left at the end of a commit (their step finished, nothing thrown away)."""
        who = ", ".join(f"{rank} (pid {pid})" for rank, pid in sorted(kept))
        how = " at the end of a commit()" if at_commit else ""
        self.console.info(f"rank{'s' if len(kept) > 1 else ''} {who} left {'their' if len(kept) > 1 else 'its'} "
                          f"group{how} in {took:.2f} s and keep{'' if len(kept) > 1 else 's'} "
                          f"{'their processes' if len(kept) > 1 else 'its process'} for the next round")

    def reform_failed(self, rank: int, error: str) -> None:
        self.console.warn(f"rank {rank} could not re-form: {error[-300:]}")

    def reform_fallback(self, handle: WorkerHandle, cause: str) -> None:
        """A worker that opted in to re-forms is restarted instead of kept: said once, with why."""
        self.events.emit("reform_fallback", rank=handle.launch.rank, local_rank=handle.launch.local_rank,
                         pid=handle.pid, cause=cause)
        self.console.warn(f"rank {handle.launch.rank} (pid {handle.pid}) is restarted instead of re-formed in its "
                          f"process: {cause}")

    def reform(self, round_: int, took: float, paused_in: float, kept: list[int], restarted: list[int],
               sources: list[str], step: int, at_commit: bool = False) -> None:
        """Every kept worker re-formed in its process."""
        self.events.emit("reform", round=round_, duration=round(took, 4), paused_in=round(paused_in, 4),
                         kept=kept, restarted=restarted, sources=sources, step=step, at_commit=at_commit)
        def local(ranks: list[int]) -> str:
            return f"local rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"

        self.console.info(f"re-formed in process {took:.2f} s after the change: {local(kept)} kept "
                          + ("their processes" if len(kept) > 1 else "its process")
                          + (f", {local(restarted)} started anew" if restarted else "")
                          + f"; every rank at step {step} (kept state: {', '.join(sources)})")
