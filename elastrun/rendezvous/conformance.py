"""The rendezvous contract as cases that every backend must pass: c10d, static where it applies, etcd,
and a third-party backend registered under the ``elastrun.rendezvous`` entry point.

A case is a function of a :class:`Jobs`, which makes the handlers of small test jobs on one backend
(its storage reached however that backend is reached: a store hosted in this process, an etcd
cluster the test started).  It runs several handlers on threads of this process, as several agents
would run them on several hosts, and checks what the agents rely on, through the public
:class:`~elastrun.rendezvous.api.RendezvousHandler` calls only:

- forming: one group, distinct group ranks, contiguous global ranks, one workers' store;
- joining a running job: the members see the joiner, and the next round admits it;
- before a first join: whether it would stop a group that trains (never where joining at once is right);
- loss: a member that leaves is reported to the others, and they form without it, uncharged;
- a closed round: a joiner beyond ``max_nodes`` waits for a later round, and is not counted as waiting;
- a token: a node with another job token cannot join;
- the round-end rules: a failure is charged to the budget and named as the next round's cause, and a
  spent budget ends the job with its culprit;
- the job's end: every member's ``finish`` is a barrier, and a node that comes later is told.

The module needs nothing but elastrun (no test framework).  A backend's tests run it like this
(pytest shown; tests/rendezvous/test_conformance.py runs elastrun's own backends)::

    import pytest
    from elastrun.rendezvous import conformance

    class MyJobs(conformance.Jobs):
        backend = "mine"
        def handler(self, job: conformance.JobSpec, node: int):
            return my_backend.create_handler(self.params(job, node, endpoint="..."))

    @pytest.mark.parametrize("case", conformance.cases_for(MyJobs), ids=lambda case: case.__name__)
    def test_conformance(case, tmp_path):
        case(MyJobs(tmp_path))

Every wait is bounded (:data:`WAIT`): a backend that hangs fails its case, it does not hang the suite.
"""

from __future__ import annotations

import abc
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elastrun.rendezvous.api import (
    FailureRecord,
    JobFailedError,
    JobFinishedError,
    NodeInfo,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
    RoundChange,
    RoundResult,
)

#: The longest any one step of a case waits: a round to close, a poll to report a change.
WAIT = 30.0
_run_ids = itertools.count()


@dataclass
class JobSpec:
    """One test job: its run id (unique per case), its node range, its budget and its token."""

    run_id: str
    min_nodes: int
    max_nodes: int
    max_restarts: int = 0
    #: The job token of every node (None: no token).  A case may give one node another.
    token: bytes | None = None
    #: ``nproc_per_node`` of every node.
    nproc: int = 2
    tokens: dict[int, bytes] = field(default_factory=dict)

    def token_of(self, node: int) -> bytes | None:
        return self.tokens.get(node, self.token)


class Jobs(abc.ABC):
    """Makes the handlers of test jobs on one backend.

    ``directory`` is a scratch directory of the case (token files).  :meth:`params` builds the
    backend-independent part of a node's parameters; :meth:`handler` adds the backend's own (its
    endpoint, its ``--rdzv-conf``) and creates the handler of node ``node`` (0, 1, ...).
    """

    #: ``--rdzv-backend`` name.
    backend: str = ""
    #: Whether membership may change between rounds (False: the static backend's fixed nodes).
    elastic: bool = True

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @abc.abstractmethod
    def handler(self, job: JobSpec, node: int) -> RendezvousHandler:
        """A new handler of node ``node`` in ``job``."""

    def node_info(self, job: JobSpec, node: int) -> NodeInfo:
        """What node ``node`` joins with (a backend with fixed ranks sets ``fixed_rank``)."""
        return NodeInfo(f"n{node}", "127.0.0.1", job.nproc, hostname=f"host{node}")

    def params(self, job: JobSpec, node: int, endpoint: str, **config: str) -> RendezvousParameters:
        """The parameters of node ``node``; its token, if any, is written to a file and given as ``token_file``."""
        token = job.token_of(node)
        if token is not None:
            path = self.directory / f"{job.run_id}-node{node}.token"
            path.write_bytes(token)
            path.chmod(0o600)
            config = {**config, "token_file": str(path)}
        return RendezvousParameters(self.backend, endpoint, job.run_id, job.min_nodes, job.max_nodes,
                                    max_restarts=job.max_restarts, config=config, node_rank=node)


def new_job(min_nodes: int, max_nodes: int, **fields) -> JobSpec:
    """A job with a run id no other case of this process uses."""
    return JobSpec(f"conformance-{next(_run_ids)}-{int(time.time() * 1000) % 100000}", min_nodes, max_nodes,
                   **fields)


class Joins:
    """``next_round`` of several nodes on threads; results and errors by node."""

    def __init__(self, jobs: Jobs, job: JobSpec) -> None:
        self.jobs, self.job = jobs, job
        self.results: dict[int, RoundResult] = {}
        self.errors: dict[int, BaseException] = {}
        self._threads: dict[int, threading.Thread] = {}

    def start(self, handler: RendezvousHandler, node: int) -> None:
        def body() -> None:
            try:
                self.results[node] = handler.next_round(self.jobs.node_info(self.job, node))
            except BaseException as exc:  # noqa: BLE001 - the case reads it
                self.errors[node] = exc

        self.results.pop(node, None)
        self.errors.pop(node, None)
        thread = threading.Thread(target=body, name=f"conformance-join-{node}", daemon=True)
        self._threads[node] = thread
        thread.start()

    def wait(self, nodes: list[int], timeout: float = WAIT) -> None:
        """Until each of ``nodes`` returned or raised (at most ``timeout`` s in all)."""
        deadline = time.monotonic() + timeout
        for node in nodes:
            self._threads[node].join(max(0.0, deadline - time.monotonic()))
        late = [n for n in nodes if self._threads[n].is_alive()]
        assert not late, f"next_round of node(s) {late} did not return within {timeout:g} s"

    def running(self, node: int) -> bool:
        return self._threads[node].is_alive()


def form(handlers: dict[int, RendezvousHandler], joins: Joins) -> dict[int, RoundResult]:
    """Every node of ``handlers`` joins the next round; the results, with no error allowed."""
    for node, handler in handlers.items():
        joins.start(handler, node)
    joins.wait(list(handlers))
    assert not joins.errors, f"next_round failed: {joins.errors}"
    return {n: joins.results[n] for n in handlers}


def poll_until(handler: RendezvousHandler, wanted: Callable[[RoundChange], bool], what: str) -> RoundChange:
    """Poll (as an agent does, every 0.1 s) until ``wanted`` holds; fails after :data:`WAIT`."""
    deadline = time.monotonic() + WAIT
    seen = RoundChange()
    while time.monotonic() < deadline:
        change = handler.poll()
        if wanted(change):
            return change
        seen = change
        time.sleep(0.1)
    raise AssertionError(f"poll never reported {what} within {WAIT:g} s (last: {seen})")


def check_one_group(results: dict[int, RoundResult], nproc: int) -> None:
    """The members agree on one group: round, generation, size, store; distinct ranks; contiguous offsets."""
    views = list(results.values())
    assert len({(r.round, r.generation, r.group_world_size, r.world_size) for r in views}) == 1, views
    assert len({(r.store_addr, r.store_port) for r in views}) == 1, "the members were given different stores"
    assert sorted(r.group_rank for r in views) == list(range(len(views)))
    assert sorted(r.rank_offset for r in views) == list(range(0, nproc * len(views), nproc))
    assert views[0].world_size == nproc * len(views)


def _failure(node: int, rank: int) -> FailureRecord:
    return FailureRecord(node_id=f"n{node}", hostname=f"host{node}", rank=rank, local_rank=0, exitcode=1,
                         signal=None, timestamp=time.time(), message="ValueError: the conformance case's fault")


def _close(handlers: dict[int, RendezvousHandler]) -> None:
    for node in sorted(handlers, reverse=True):  # the c10d store's host (node 0) last
        try:
            handlers[node].close()
        except Exception:  # noqa: BLE001 - a case's own failure is the one to report
            pass


# ---------------------------------------------------------------------------------------------- cases
def forms_one_group(jobs: Jobs) -> None:
    job = new_job(3, 3)
    handlers = {n: jobs.handler(job, n) for n in range(3)}
    try:
        results = form(handlers, Joins(jobs, job))
        check_one_group(results, job.nproc)
        assert {r.round for r in results.values()} == {0} and {r.generation for r in results.values()} == {0}
        for node, result in results.items():
            member = next(m for m in result.members if m.node_id == f"n{node}")
            assert (member.group_rank, member.rank_offset) == (result.group_rank, result.rank_offset)
    finally:
        _close(handlers)


def admits_a_node_joining_a_running_job(jobs: Jobs) -> None:
    job = new_job(2, 3)
    handlers = {n: jobs.handler(job, n) for n in range(3)}
    joins = Joins(jobs, job)
    try:
        first = form({n: handlers[n] for n in (0, 1)}, joins)
        check_one_group(first, job.nproc)
        joins.start(handlers[2], 2)
        change = poll_until(handlers[0], lambda c: c.nodes_waiting > 0, "a node waiting to join")
        assert change.restart_needed
        for node in (0, 1):
            joins.start(handlers[node], node)
        joins.wait([0, 1, 2])
        assert not joins.errors, joins.errors
        second = joins.results
        check_one_group(second, job.nproc)
        assert {r.generation for r in second.values()} == {first[0].generation + 1}
        for node in (0, 1):  # a member keeps its group rank across a resize
            assert second[node].group_rank == first[node].group_rank
    finally:
        _close(handlers)


def tells_a_joiner_whether_its_join_stops_a_running_group(jobs: Jobs) -> None:
    """``join_interrupts``: never True where joining at once is right (the first round, a member, a
    round forming, a full group); True for a newcomer to a group that trains, where the backend
    answers at all (the default, False, is allowed: the agent then joins at once)."""
    job = new_job(2, 3)
    handlers = {n: jobs.handler(job, n) for n in range(3)}
    answers = type(handlers[2]).join_interrupts is not RendezvousHandler.join_interrupts
    joins = Joins(jobs, job)
    try:
        assert not handlers[2].join_interrupts(), "a job's first round: nothing to interrupt"
        first = form({n: handlers[n] for n in (0, 1)}, joins)
        assert not handlers[0].join_interrupts(), "a member asked whether its join interrupts itself"
        assert handlers[2].join_interrupts() == answers, "a newcomer to a group that trains, below max_nodes"
        joins.start(handlers[0], 0)  # a member goes round again (its workers failed): a round is forming
        deadline = time.monotonic() + WAIT
        while handlers[2].join_interrupts() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not handlers[2].join_interrupts(), "a round is forming: the newcomer must join it at once"
        joins.start(handlers[2], 2)  # the newcomer first: the round closes once the last member is back
        poll_until(handlers[1], lambda c: c.nodes_waiting > 0, "the newcomer waiting in the forming round")
        joins.start(handlers[1], 1)
        joins.wait([0, 1, 2])
        assert not joins.errors, joins.errors
        check_one_group(joins.results, job.nproc)
        assert {r.round for r in joins.results.values()} == {first[0].round + 1}
        late = jobs.handler(job, 3)
        try:
            assert not late.join_interrupts(), "the group is at max_nodes: a join waits, it stops nobody"
        finally:
            late.close()
    finally:
        _close(handlers)


def reports_a_member_that_leaves_and_forms_without_it(jobs: Jobs) -> None:
    job = new_job(2, 3)
    handlers = {n: jobs.handler(job, n) for n in range(3)}
    try:
        first = form(handlers, Joins(jobs, job))
        check_one_group(first, job.nproc)
        handlers[2].leave("pre-empted")
        for node in (0, 1):
            change = poll_until(handlers[node], lambda c: "n2" in c.lost_nodes, "the loss of n2")
            assert change.restart_needed
        second = form({n: handlers[n] for n in (0, 1)}, Joins(jobs, job))
        check_one_group(second, job.nproc)
        assert {tuple(r.lost_nodes) for r in second.values()} == {("n2",)}
        assert {r.restarts_used for r in second.values()} == {0}, "a node that left was charged"
    finally:
        _close(handlers)


def keeps_a_late_joiner_out_of_a_full_round(jobs: Jobs) -> None:
    job = new_job(2, 2)
    handlers = {n: jobs.handler(job, n) for n in range(3)}
    joins = Joins(jobs, job)
    try:
        first = form({n: handlers[n] for n in (0, 1)}, joins)
        joins.start(handlers[2], 2)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the group is at max_nodes: the joiner is not a reason to restart
            change = handlers[0].poll()
            assert not change.nodes_waiting and not change.restart_needed, change
            time.sleep(0.1)
        assert joins.running(2), "a node joined a round that was full"
        handlers[1].leave("pre-empted")
        poll_until(handlers[0], lambda c: "n1" in c.lost_nodes, "the loss of n1")
        joins.start(handlers[0], 0)
        joins.wait([0, 2])
        assert not joins.errors, joins.errors
        second = {n: joins.results[n] for n in (0, 2)}
        check_one_group(second, job.nproc)
        assert second[0].round > first[0].round
    finally:
        _close(handlers)


def refuses_a_node_with_another_token(jobs: Jobs) -> None:
    job = new_job(2, 2, token=b"conformance-token-0123456789abcdef", tokens={2: b"another-token-0123456789abcdef0123"})
    handlers = {n: jobs.handler(job, n) for n in (0, 1)}
    try:
        check_one_group(form(handlers, Joins(jobs, job)), job.nproc)  # the job exists, under its token
        try:
            stranger = jobs.handler(job, 2)
        except RendezvousTimeoutError:
            raise
        except RendezvousError:
            return  # refused when it connected
        try:
            joins = Joins(jobs, job)
            joins.start(stranger, 2)
            joins.wait([2])
            error = joins.errors.get(2)
            assert isinstance(error, RendezvousError) and not isinstance(error, RendezvousTimeoutError), (
                f"a node with another token was not refused: {error or joins.results}")
        finally:
            stranger.close()
    finally:
        _close(handlers)


def charges_failures_and_ends_the_job_when_the_budget_is_spent(jobs: Jobs) -> None:
    job = new_job(2, 2, max_restarts=1)
    handlers = {n: jobs.handler(job, n) for n in range(2)}
    try:
        first = form(handlers, Joins(jobs, job))
        failed = next(n for n, r in first.items() if r.group_rank == 1)
        handlers[failed].report_failure(_failure(failed, first[failed].rank_offset))
        second = form(handlers, Joins(jobs, job))
        assert {r.restarts_used for r in second.values()} == {1}
        causes = {(r.cause.node_id, r.cause.rank) if r.cause else None for r in second.values()}
        assert causes == {(f"n{failed}", first[failed].rank_offset)}, causes
        handlers[failed].report_failure(_failure(failed, second[failed].rank_offset))
        joins = Joins(jobs, job)
        for node, handler in handlers.items():
            joins.start(handler, node)
        joins.wait(list(handlers))
        assert set(joins.errors) == set(handlers) and not joins.results, "the job went on past its budget"
        for error in joins.errors.values():
            assert isinstance(error, JobFailedError), error
            assert f"host{failed}" in str(error) + error.summary, error.summary
    finally:
        _close(handlers)


def finishes_with_a_barrier_and_tells_a_late_node(jobs: Jobs) -> None:
    job = new_job(2, 2)
    handlers = {n: jobs.handler(job, n) for n in range(2)}
    try:
        form(handlers, Joins(jobs, job))
        done: dict[int, bool] = {}
        threads = [threading.Thread(target=lambda n=n: done.__setitem__(n, handlers[n].finish(WAIT)), daemon=True)
                   for n in handlers]
        threads[0].start()
        time.sleep(0.3)
        assert 0 not in done, "finish returned before every member finished"
        threads[1].start()
        for t in threads:
            t.join(WAIT)
        assert done == {0: True, 1: True}, done
        if jobs.elastic:
            late = jobs.handler(job, 2)
            try:
                joins = Joins(jobs, job)
                joins.start(late, 2)
                joins.wait([2])
                assert isinstance(joins.errors.get(2), JobFinishedError), joins.errors or joins.results
            finally:
                late.close()
    finally:
        _close(handlers)


#: Every case, in the order above.
CASES: list[Callable[[Jobs], None]] = [
    forms_one_group,
    admits_a_node_joining_a_running_job,
    tells_a_joiner_whether_its_join_stops_a_running_group,
    reports_a_member_that_leaves_and_forms_without_it,
    keeps_a_late_joiner_out_of_a_full_round,
    refuses_a_node_with_another_token,
    charges_failures_and_ends_the_job_when_the_budget_is_spent,
    finishes_with_a_barrier_and_tells_a_late_node,
]
#: The cases that need a node beyond the job's fixed ones (skipped for a backend whose :attr:`Jobs.elastic`
#: is False: there a third node is a configuration error, and its token is checked end to end).
ELASTIC_ONLY = {admits_a_node_joining_a_running_job, tells_a_joiner_whether_its_join_stops_a_running_group,
                reports_a_member_that_leaves_and_forms_without_it,
                keeps_a_late_joiner_out_of_a_full_round, refuses_a_node_with_another_token}


def cases_for(jobs: type[Jobs]) -> list[Callable[[Jobs], None]]:
    """The cases that apply to a backend: all of them, less :data:`ELASTIC_ONLY` for fixed membership."""
    return [case for case in CASES if jobs.elastic or case not in ELASTIC_ONLY]
