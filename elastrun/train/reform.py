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
peer died or stopped, or computing):

* the group's TCP connections are shut down (``shutdown(2)`` on the sockets the group opened,
  found by inode), which makes a pending or later gloo collective fail at once even when the
  peer is alive but silent (SIGSTOPped): ``ProcessGroupGloo.abort()`` does not wake a pending
  collective in torch 2.13;
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
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from elastrun.shared.protocol import WAIT_ENV, Assign, Failed, Pause, Paused, Reformed, ToAgent, ToWorker
from elastrun.shared.sockets import connected_tcp, socket_inodes
from elastrun.train import copier, notes, stuck
from elastrun.train.dist import DistInfo, forget_mesh_caches, init_distributed
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


# ------------------------------------------------------------------------------------- sockets
def _connected_tcp(fd: int) -> socket.socket | None:
    """A duplicate of ``fd`` if it is a connected (not listening) TCP socket, else None."""
    try:
        return connected_tcp(os.dup(fd))
    except OSError:
        return None


def _ended(fd: int) -> bool | None:
    """Whether connection ``fd`` reads end-of-file or an error (None: not a connected TCP socket)."""
    sock = _connected_tcp(fd)
    if sock is None:
        return None
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    finally:
        sock.close()


class GroupSockets:
    """The TCP connections of the current default process group, found by what its init opened.

    Shutting a gloo listener down would abort the process (gloo's accept loop enforces success),
    so only connected sockets are touched.
    """

    def __init__(self) -> None:
        self._before: set[int] | None = None  # sockets that existed when the current init began
        self._group: set[int] = set()

    def init_begins(self) -> None:
        self._before = set(socket_inodes())
        self._group = set()

    def init_done(self) -> None:
        if self._before is not None:
            self._group = set(socket_inodes()) - self._before
        self._before = None

    def _targets(self) -> dict[int, int]:
        now = socket_inodes()
        if self._before is not None:  # during an init: whatever it opened so far
            return {i: fd for i, fd in now.items() if i not in self._before}
        return {i: fd for i, fd in now.items() if i in self._group}

    def shutdown(self) -> None:
        """Shut down every connection of the group: its pending and later collectives fail."""
        for fd in self._targets().values():
            sock = _connected_tcp(fd)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def connections_open(self) -> int | None:
        """How many of the group's connections could still carry a byte (None: it has none to watch).

        A connection shut down (by the pause), closed by its peer, failed or closed here is not open."""
        if not self._group:
            return None
        now = socket_inodes()
        return sum(1 for inode in self._group if inode in now and _ended(now[inode]) is False)

    def peer_lost(self) -> bool:
        """Whether a connection of the group was closed by its peer (or is gone)."""
        now = socket_inodes()
        return any(inode not in now or _ended(now[inode]) for inode in self._group)

    def forget(self) -> None:
        self._before = None
        self._group = set()


# ------------------------------------------------------------------------------------- the link
class Link:
    """This worker's side of a re-form: the control connection, the pause flag and the interrupt."""

    def __init__(self) -> None:
        self.sockets = GroupSockets()
        self._cond = threading.Condition()
        self.pause_pending = False
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
        with self._cond:
            if message is None:
                self.closed = True
            elif isinstance(message, Pause):
                self.pause_pending = True
            elif isinstance(message, Assign):
                self._assign = message
            self._cond.notify_all()
        if isinstance(message, Pause):
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
            raise Reform("the agent asked this worker to leave its process group")

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        """A State section: a pause arriving inside is raised when it ends (normally)."""
        self.critical += 1
        try:
            yield
        finally:
            self.critical -= 1
        if self.critical == 0 and self.in_fn and self.pause_pending:
            raise Reform("the agent asked this worker to leave its process group")

    def wait_pause(self, timeout: float) -> bool:
        """Wait for the agent's pause (bounded); True when it came."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.pause_pending and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self.pause_pending

    def paused(self, live: int | None) -> None:
        """Tell the agent this worker left its group (clears the pause flag)."""
        with self._cond:
            self.pause_pending = False
        self.send(Paused(live=live, pid=os.getpid()))

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
