"""Copying a step's state into a memory-snapshot slot with the CPU time training leaves idle.

The copy of a large state (768 MiB for a 100M-parameter model with SGD momentum) takes about
0.1 s of one core.  Run on an ordinary helper thread during the next step, it preempts one of
the step's OpenMP threads; the others then spin at their barriers, and the step loses several
times the copy's own time (measured: 0.1 s of copying cost a 0.55 s step 0.2-0.4 s).

:class:`SnapshotCopy` therefore splits the copy into chunks taken, in order, by two workers:

- the process's helper thread at ``SCHED_IDLE`` priority, which only runs when a core would
  otherwise idle (between steps, in data loading, while a collective waits); it stays there even
  where it could not leave it again (:mod:`elastrun.shared.priority` says why);
- the training thread, which calls :meth:`SnapshotCopy.finish` just before ``optimizer.step()``
  changes the parameters, copies whatever is left at its own priority, and waits for the chunk
  the helper is in the middle of.

So the copy never costs more than doing it on the training thread, and costs nothing where the
step leaves a core idle long enough.  Usage::

    copy = SnapshotCopy(flat, buffer)
    copy.start()        # helper thread begins taking chunks
    ...                 # forward, backward
    copy.finish()       # before the parameters change
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from elastrun.shared import priority
from elastrun.train.blob import Flattened, as_bytes

#: Bytes per chunk: small enough that the training thread never waits long for the helper's
#: chunk in flight, large enough that taking a chunk costs nothing next to copying it.
CHUNK_BYTES = 8 << 20
#: A copy smaller than this is made at once, on the caller's thread (tens of microseconds): a helper
#: thread would cost as much to start, and an idle-priority thread alive on a busy host holds up the
#: end of a killed worker (see :class:`_IdleWorker`).
HELPER_MIN_BYTES = 1 << 20


@dataclass
class _Chunk:
    source: torch.Tensor  # keeps the (possibly made-contiguous) source alive until copied
    offset: int  # into the source, bytes
    destination: int  # address in the slot
    nbytes: int


def copy_chunk(destination: int, source: int, nbytes: int) -> None:
    """One ``memmove`` (single-threaded; ctypes releases the GIL while it runs)."""
    ctypes.memmove(destination, source, nbytes)


class _IdleWorker:
    """The process's idle-priority helper: a thread started when a copy is given, which ends as soon as
    no copy waits.

    A thread at idle priority must not outlive its work: a process ends only when each of its threads
    has run its exit, and a parked idle-priority thread may get no CPU on a busy host, holding up the
    end of a killed process and the closing of the sockets its peers wait on (measured in the agent,
    whose replicator parked one: 10-13 s, :mod:`elastrun.agent.replicator`).
    """

    def __init__(self) -> None:
        self._jobs: collections.deque[SnapshotCopy] = collections.deque()
        self._running = False
        self._pid = 0
        self._lock = threading.Lock()
        self._tid = 0  # the helper's kernel thread id, while it runs

    def give(self, copy: SnapshotCopy) -> None:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's helper is not here
                self._pid, self._jobs, self._running, self._tid = os.getpid(), collections.deque(), False, 0
            self._jobs.append(copy)
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._serve, name="elastrun-idle-copy", daemon=True).start()

    def _serve(self) -> None:
        self._tid = threading.get_native_id()
        while True:
            with self._lock:
                if not self._jobs:
                    self._running, self._tid = False, 0
                    return
                job = self._jobs.popleft()
            priority.lower(idle_for_good=True)  # again for each job: a wait may have raised it (see boost)
            job._work()

    def boost(self) -> None:
        """Let the helper run at normal priority until its next job: the training thread waits for
        a chunk the helper holds, and on a loaded machine an idle-priority thread can wait seconds
        for a core (a priority inversion that would stall ``commit()`` and a re-form's pause)."""
        tid = self._tid
        if tid and self._pid == os.getpid():
            priority.restore(tid)


_IDLE_WORKER = _IdleWorker()


#: Kernel thread ids of other threads running at idle priority for this process (see :func:`at_idle_priority`).
_IDLE_THREADS: set[int] = set()


@contextmanager
def at_idle_priority() -> Iterator[None]:
    """Run the calling thread's block at ``SCHED_IDLE``, known to :func:`boost_idle_threads` meanwhile."""
    tid = threading.get_native_id()
    _IDLE_THREADS.add(tid)
    try:
        priority.lower(idle_for_good=True)
        yield
    finally:
        _IDLE_THREADS.discard(tid)
        priority.restore(tid)  # best effort: without CAP_SYS_NICE the thread stays low (use a thread of its own)


def boost_idle_threads() -> None:
    """Put this process's idle-priority threads at normal priority (the copy helper until its next job;
    best effort: an unprivileged thread may not leave ``SCHED_IDLE``): a re-form's pause must not
    wait on a thread that gets no CPU while it holds, or waits for, the interpreter lock that the
    training and control threads need."""
    _IDLE_WORKER.boost()
    for tid in list(_IDLE_THREADS):
        priority.restore(tid)


class SnapshotCopy:
    """Copies the CPU tensors of ``flat`` into ``buffer`` (a CPU ``uint8`` tensor) at their offsets.

    Tensors on another device are not handled here: the caller copies them (``copy_into`` with
    their indices).  ``buffer`` and the tensors of ``flat`` must stay alive until :meth:`wait`
    (or :meth:`finish`) returned.
    """

    def __init__(self, flat: Flattened, buffer: torch.Tensor, chunk_bytes: int = CHUNK_BYTES,
                 skip: Collection[int] = ()) -> None:  # fmt: skip
        self.device_indices: list[int] = []
        #: Whether :meth:`start` handed the chunks to the helper (False: copied at once, or not yet).
        self.background = False
        #: Seconds from :meth:`start` to the last chunk copied (None until then).
        self.seconds: float | None = None
        self._began = 0.0
        self._chunks: list[_Chunk] = []
        base = buffer.data_ptr()
        for i, (tensor, entry) in enumerate(zip(flat.tensors, flat.entries, strict=True)):
            if not entry.nbytes or i in skip:  # skip: the snapshot pipeline's device copy takes them
                continue
            if tensor.device.type != "cpu" or buffer.device.type != "cpu":
                self.device_indices.append(i)
                continue
            source = as_bytes(tensor)
            for start in range(0, entry.nbytes, chunk_bytes):
                n = min(chunk_bytes, entry.nbytes - start)
                self._chunks.append(_Chunk(source, start, base + entry.offset + start, n))
        self._next = 0
        self._done = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def start(self) -> None:
        """Hand the chunks to the idle-priority helper thread (a copy under :data:`HELPER_MIN_BYTES`: copy
        them now)."""
        self._began = time.perf_counter()
        if sum(c.nbytes for c in self._chunks) < HELPER_MIN_BYTES:
            self._work()
        elif self._chunks:
            self.background = True
            _IDLE_WORKER.give(self)

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._next >= len(self._chunks) or self._error is not None:
                    return
                chunk = self._chunks[self._next]
                self._next += 1
            try:
                copy_chunk(chunk.destination, chunk.source.data_ptr() + chunk.offset, chunk.nbytes)
            except BaseException as e:  # re-raised by wait() on the caller's thread
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._done += 1
                if self._done == len(self._chunks):
                    self.seconds = time.perf_counter() - self._began
                    self._cond.notify_all()

    def finish(self) -> None:
        """Copy the chunks nobody has taken yet on this thread, then wait for the rest."""
        self._work()
        self.wait()

    def wait(self) -> None:
        """Block until every chunk is copied; re-raise a chunk's failure."""
        with self._cond:
            if self._done < len(self._chunks) and self._error is None:
                _IDLE_WORKER.boost()
            while self._done < len(self._chunks) and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError(f"memory snapshot copy failed: {self._error}") from self._error

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._done == len(self._chunks)
