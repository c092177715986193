"""``run(fn, state)``: training that keeps its process when the job changes around it.

Without this, elastrun answers a change (another worker failed, a node was lost, a node joins)
by killing every worker and starting new ones.  A script that puts its training body in a
function and hands it to :func:`run` opts in to *re-forms* instead: when its agent says
``pause`` (see :mod:`elastrun.worker.control_client`), the training thread leaves whatever it was
doing, the default process group is torn down, the worker waits for the new round's environment,
joins the new group with its new rank and world size, rolls its state back to the last commit
agreed by every rank (``State.restore()``, from its own objects where it can) and calls ``fn``
again.  Its process, imports, model and optimizer objects stay.

How the training thread is made to leave (the worker is usually blocked in a collective whose
peer died or stopped, or computing).  For a join, where the group is whole, it first goes on to
the end of its next ``commit()`` if that is near, and every rank leaves there
(:mod:`elastrun.train.commit_pause`); otherwise, and for a fault:

* the group's TCP connections are shut down (``shutdown(2)`` on the sockets the group opened,
  found by inode: :mod:`elastrun.train.group_sockets`), which makes a pending or later gloo
  collective fail at once even when the peer is alive but silent (SIGSTOPped):
  ``ProcessGroupGloo.abort()`` does not wake a pending collective in torch 2.13;
* a real-time signal to the main thread, whose Python handler raises :class:`Reform` when the
  thread is in the user's code (between bytecodes: pure-Python compute, ``time.sleep``), and
  defers it while ``State`` is inside ``commit()``/``restore()``, which then raise it on return.

A collective that fails on its own because a peer's connection closed (a peer died) does not
kill the worker: it waits up to ``ELASTRUN_REFORM_WAIT`` seconds for its agent's ``pause``, and
re-raises the error if none comes.  Any other error is re-raised at once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from elastrun.shared.protocol import WAIT_ENV, Assign, Failed, Pause, Paused, Reformed, ToAgent, ToWorker
from elastrun.train import copier, notes, stuck
from elastrun.train.commit_pause import CommitClock, commit_deadline
from elastrun.train.dist import DistInfo, forget_mesh_caches, init_distributed
from elastrun.train.group_sockets import GroupSockets
from elastrun.train.reformable import Reformable
from elastrun.worker import heartbeat, pg_guard
from elastrun.worker.control_client import ControlClient

T = TypeVar("T")
S = TypeVar("S", bound=Reformable)  # a State: run and State meet only in reformable.py

#: The signal that interrupts the training thread (a real-time one: no user meaning, queued).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 3
#: Destroyed process groups kept referenced (see ``pg_guard``): those of the last re-forms only.
KEEP_GROUPS = 2


class Reform(BaseException):
    """Raised in the training thread when its agent asks it to leave the process group.

    A ``BaseException`` so that the user's ``except Exception`` blocks do not swallow it.
    """


# ------------------------------------------------------------------------------------- the link
class Link:
    """This worker's side of a re-form: the control connection, the pause flag and the interrupt."""

    def __init__(self) -> None:
        self.sockets = GroupSockets()
        self._cond = threading.Condition()
        #: The training thread must leave now (a hard pause, or the group agreed at a commit).
        self.pause_pending = False
        #: The agent asked for a pause, and this worker has not answered yet.
        self.asked = False
        #: The agent asked to leave at the next commit (:mod:`~elastrun.train.commit_pause`), due by a timer.
        self.soft_pending = False
        self._soft_timer: threading.Timer | None = None
        #: The commit at whose end the group agreed to leave (None: interrupted, or not left), and why.
        self.left_at: int | None = None
        self._left_for = ""
        self.clock = CommitClock()
        self._assign: Assign | None = None
        self.closed = False
        #: Whether the training thread runs the user's function (where a Reform may be raised).
        self.in_fn = False
        #: Depth of State sections that must not be interrupted (a Reform is raised on leaving them).
        self.critical = 0
        self._main = threading.main_thread().ident
        self._main_tid = threading.get_native_id()  # built on the training (main) thread, by run()
        self._client = ControlClient.from_env(self._on_message)
        self._previous_handler: Any = None
        self._watching = False
        self.wait_s = float(os.environ.get(WAIT_ENV, "30") or 30)

    @property
    def active(self) -> bool:
        return self._client is not None

    def start(self, local_rank: int) -> None:
        if self._client is None:
            return
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(INTERRUPT_SIGNAL, self._on_interrupt)
            signal.siginterrupt(INTERRUPT_SIGNAL, False)  # C calls resume; Python code sees the raise
        self._client.hello(local_rank)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._previous_handler is not None:
            signal.signal(INTERRUPT_SIGNAL, self._previous_handler)
            self._previous_handler = None

    def send(self, message: ToAgent) -> None:
        if self._client is not None:
            self._client.send(message)

    # -- reader thread -------------------------------------------------------------------------
    def _on_message(self, message: ToWorker | None) -> None:
        if isinstance(message, Pause):  # first: nothing below may wait on a starved idle-priority helper
            copier.boost_idle_threads()
        now = False
        with self._cond:
            if message is None:
                self.closed = True
            elif isinstance(message, Pause):
                self.asked = True
                if not self.pause_pending and not self._leave_at_commit(message.within):
                    self.pause_pending = now = True
            elif isinstance(message, Assign):
                self._assign = message
            self._cond.notify_all()
        if now:
            self._interrupt()

    def _leave_at_commit(self, within: float) -> bool:
        """Wait for the next commit instead of interrupting, if it is near (under ``_cond``)."""
        if within <= 0 or not self.in_fn:  # a fault's pause cuts short a wait for a commit
            self._stop_soft()
            return False
        if self.soft_pending:
            return True
        deadline = commit_deadline(time.monotonic(), self.clock.last, self.clock.gap, within)
        if deadline is None:
            return False
        self.soft_pending = True
        self._soft_timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._commit_overdue)
        self._soft_timer.daemon = True
        self._soft_timer.start()
        return True

    def _commit_overdue(self) -> None:
        """The next commit did not come in time: interrupt the training thread as a fault's pause does."""
        with self._cond:
            if not self.soft_pending or self.pause_pending:
                return
            self.soft_pending = False
            self.pause_pending = True
            self._cond.notify_all()
        self._interrupt()

    def _interrupt(self) -> None:
        """Make the training thread leave wherever it is: its group's connections, then the signal."""
        self.sockets.shutdown()
        if self._previous_handler is not None and self._main is not None:
            try:
                signal.pthread_kill(self._main, INTERRUPT_SIGNAL)
            except (OSError, ValueError):
                pass
            self._watch_leave()

    def _watch_leave(self) -> None:
        """Tell the agent at once when the training thread cannot leave (:mod:`elastrun.train.stuck`)."""
        main = self._main
        if self._watching or main is None:
            return
        self._watching = True

        def body() -> None:
            try:
                stuck.watch(main, self._main_tid, lambda: self.pause_pending and self.in_fn,
                            self.sockets.connections_open, lambda why: self.send(Failed(error=why)))
            finally:
                self._watching = False

        threading.Thread(target=body, name="elastrun-leave-watch", daemon=True).start()

    # -- training thread -------------------------------------------------------------------------
    def _on_interrupt(self, _signum: int, _frame: Any) -> None:
        if self.pause_pending and self.in_fn and self.critical == 0:
            raise Reform(self._why())

    def _why(self) -> str:
        if self.left_at is not None:
            return f"the group left at the end of commit {self.left_at} ({self._left_for})"
        return "the agent asked this worker to leave its process group"

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        """A State section: a pause arriving inside is raised when it ends (normally)."""
        self.critical += 1
        try:
            yield
        finally:
            self.critical -= 1
        if self.critical == 0 and self.in_fn and self.pause_pending:
            raise Reform(self._why())

    def vote(self) -> int:
        """This rank's vote in the commit's flags: 1 when it is to leave (the group leaves with it)."""
        return int(self.soft_pending or self.pause_pending)

    def committed(self, step: int, leave_for: str | None) -> None:
        """A commit ended; ``leave_for`` (why; None: go on): every rank leaves at its end, raised as
        the commit's section ends.  A rank voted for a join's pause, or a pre-empted rank exits there
        (the others would wait for it in their next collective, their step thrown away)."""
        self.clock.committed(time.monotonic())
        if leave_for is None or not self.in_fn:
            return
        with self._cond:
            self.left_at, self._left_for = step, leave_for
            self.pause_pending = True
            self._stop_soft()

    def _stop_soft(self) -> None:
        self.soft_pending = False
        if self._soft_timer is not None:
            self._soft_timer.cancel()
            self._soft_timer = None

    def wait_pause(self, timeout: float) -> bool:
        """Wait for the agent's pause (bounded); True when it came."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.asked and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self.asked

    def paused(self, live: int | None) -> None:
        """Tell the agent this worker left its group (clears the pause flags)."""
        with self._cond:
            at_commit = self.left_at is not None
            self.pause_pending = self.asked = False
            self.left_at = None
            self._stop_soft()
        self.clock.reset()
        self.send(Paused(live=live, pid=os.getpid(), at_commit=at_commit))

    def wait_assign(self) -> Assign:
        """The new round's assignment (waits as long as the agent needs; it kills us otherwise)."""
        with self._cond:
            while self._assign is None:
                if self.closed:
                    raise RuntimeError("the elastrun agent closed the control connection during a re-form")
                self._cond.wait(1.0)
            message, self._assign = self._assign, None
            return message


_link: Link | None = None


def active() -> bool:
    """Whether this process runs under :func:`run` with a control connection (re-forms possible)."""
    return _link is not None


@contextlib.contextmanager
def section() -> Iterator[None]:
    """Used by ``State``: defer a re-form's interrupt to the end of this section."""
    link = _link
    if link is None:
        yield
        return
    with link.section():
        yield


def vote() -> int:
    """Used by ``State.commit()``: 1 when this rank is to leave its group (a pause is asked)."""
    link = _link
    return 0 if link is None else link.vote()


def committed(step: int, leave_for: str | None) -> None:
    """Used by ``State.commit()`` inside its section: the commit ended; ``leave_for``: why every rank
    leaves the group at its end (None: they go on)."""
    link = _link
    if link is not None:
        link.committed(step, leave_for)


# ------------------------------------------------------------------------------------- run
def _init(link: Link, backend: str | None, timeout_s: float) -> DistInfo:
    link.sockets.init_begins()
    try:
        return init_distributed(backend, timeout_s)
    finally:
        link.sockets.init_done()


def _leave_group(link: Link) -> None:
    """Tear down the default group (kept referenced by pg_guard, the oldest ones released)."""
    link.sockets.shutdown()
    link.sockets.forget()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a broken group: forgetting it is all that matters
            notes.warn(f"destroying the old process group failed: {exc}")
    pg_guard.release_oldest(KEEP_GROUPS)
    forget_mesh_caches()  # issue 24: DTensor's caches hold the old group's meshes
    gc.collect()  # the old DistributedDataParallel (its reducer's autograd hooks) goes now


def _should_wait(link: Link, exc: BaseException) -> bool:
    """Whether an error from the user's function is a re-form to go through, not a failure."""
    if link.pause_pending or isinstance(exc, Reform):
        return True
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return False
    return link.sockets.peer_lost() and link.wait_pause(link.wait_s)


def run(fn: Callable[[S], T], state: S, backend: str | None = None, timeout_s: float = 1800.0) -> T:
    """Run ``fn(state)`` until it returns, re-forming in process when the job changes.

    Creates the default process group (:func:`init_distributed`), restores ``state``
    (``state.restore()``), then calls ``fn(state)``.  Under elastrun, when the agent asks for a
    re-form, ``fn`` is left (a :class:`Reform` exception, or its collective failing), the group is
    re-created with the new rank and world size, ``state`` is rolled back to the last commit all
    ranks agree on, and ``fn(state)`` is called again.  Outside elastrun (or without a control
    socket) it is ``init_distributed(); state.restore(); return fn(state)``.

    ``fn`` must build everything that depends on the group inside itself: the
    ``DistributedDataParallel`` wrapper, DataLoader iterators over the sampler, anything that reads
    the rank or world size.  See docs/train.md for the contract.
    """
    global _link
    link = Link()
    info = _init(link, backend, timeout_s)
    if link.active and dist.get_backend() != "gloo":
        link.close()  # NCCL re-forms are designed (docs/train.md), not built: restarts as before
    if not link.active:
        state.restore()
        return fn(state)
    _link = link
    link.start(info.local_rank)
    restored = False
    try:
        while True:
            try:
                if not restored:
                    with link.section():
                        state.restore()
                    restored = True
                link.in_fn = True
                try:
                    return fn(state)
                finally:
                    link.in_fn = False
            except BaseException as exc:
                if not _should_wait(link, exc):
                    raise
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200] if str(exc) else type(exc).__name__
                del exc
            _reform(link, state, backend, timeout_s, reason)
            restored = True
    finally:
        _link = None
        link.close()


def _reform(link: Link, state: Reformable, backend: str | None, timeout_s: float, reason: str) -> None:
    """Leave the group, take the agent's new assignment, join the new group and roll back."""
    for _ in range(1000):  # each pass is one pause from the agent; bounded by its restarts anyway
        left = False
        try:
            _leave_group(link)
            if not link.wait_pause(link.wait_s):  # left with the group before its own agent asked
                raise RuntimeError("the elastrun agent closed the control connection during a re-form" if link.closed
                                   else f"this worker left its group with the others at a commit, and its agent "
                                   f"did not ask it to within {link.wait_s:g} s")
            link.paused(state.live_step())
            left = True
            message = link.wait_assign()
            t0 = time.monotonic()
            os.environ.update(message.env)
            heartbeat.reset()
            _init(link, backend, timeout_s)
            state.rebind()
            source = state.restore()
            link.send(Reformed(round=message.round, source=source, step=state.step,
                               took=round(time.monotonic() - t0, 4), after=reason))
            return
        except BaseException as exc:
            if left and link.pause_pending and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                continue  # another change came while this one was being made: go round again
            link.send(Failed(error="".join(traceback.format_exception_only(exc)).strip()[:2000]))
            raise
    raise RuntimeError("elastrun.train: too many re-forms in a row")
