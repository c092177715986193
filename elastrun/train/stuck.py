"""After a pause: is the training thread stuck in a call that can no longer return?  (worker side)

A paused worker leaves its group when its training thread gets out of whatever it was doing: a
collective fails once the group's connections are shut down (:mod:`elastrun.train.reform`).  One
collective never does.  gloo (torch 2.13 and before) hands a failed connection's error to the sends and
receives still waiting for their peer, but not to a send whose bytes sit in the connection's write
queue: a transfer larger than the socket's buffer that the peer stopped reading, or a write that
failed silently because the peer's reset came first.  That send waits for the group's timeout
(30 minutes by default).  Seen here as::

    main thread: dist.send / all_reduce / backward -> work.wait(), forever;
    gloo: every connection of the group closed, one worker thread in UnboundBuffer::waitSend.

Without this module the agent waits ``--reform-timeout`` (5 s) for an answer, then restarts the worker
from its memory snapshot.  With it, the worker says so itself (``Failed``) as soon as it is certain, so the
restart starts about 1 s after the pause.  Certain means, together:

* the pause is still unanswered and the training thread is in the user's function;
* no TCP connection of the group can carry a byte any more: each is shut down (by the pause), closed by
  its peer, or closed here (gloo closes a connection when it fails);
* the training thread's innermost Python frame is in ``torch.distributed``, ``torch.autograd`` or
  ``torch.nn.parallel`` (a collective, or DDP's backward waiting for one), and has been the same frame
  for :data:`GRACE_S` seconds, asleep, without using any CPU time.

A backward still computing uses CPU; a collective that failed returns within milliseconds of its
connection closing; user code waiting on anything else is in another frame.  None of them is reported.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastrun.shared.procstat import stat_fields

#: How long the training thread must sit still in the same torch frame, every connection closed.
GRACE_S = 1.0
#: How long the watch lasts at most (the agent gives up on the pause well before: ``--reform-timeout``).
BOUND_S = 60.0
#: Where a call waits on a collective: a torch frame under one of these folders.
_COLLECTIVE_DIRS = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/")
_POLL_S = 0.1


@dataclass(frozen=True)
class Sample:
    """What the training thread was doing at one moment."""

    file: str  #: the innermost Python frame's file
    where: str  #: ``function (file name:line)``, for the message
    state: str  #: the kernel's state letter (S: asleep, D: uninterruptible, R: running)
    cpu: int  #: CPU time used so far, in clock ticks (user + system)


def in_collective(file: str) -> bool:
    """Whether a frame of ``file`` is one where a call waits on a collective."""
    return any(d in file for d in _COLLECTIVE_DIRS)


def cannot_return(first: Sample, last: Sample, connections_open: int | None) -> bool:
    """Whether a training thread seen as ``first`` then, :data:`GRACE_S` later, as ``last`` is stuck for
    good in a collective of a group with ``connections_open`` connections left (None: the group had
    none to watch, as at world size 1)."""
    return (
        connections_open == 0
        and in_collective(first.file)
        and last.where == first.where
        and last.state in ("S", "D")
        and last.cpu == first.cpu
    )


def sample(ident: int, tid: int) -> Sample | None:
    """The innermost frame of the thread ``ident`` (kernel thread ``tid``), its state and CPU time; None
    if either cannot be read.  ``tid`` is read by the thread itself (``threading.get_native_id()``):
    ``Thread.native_id`` can be the forking process's in a forked child."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return None
    fields = stat_fields("self", tid)
    if len(fields) < 13:
        return None
    code = frame.f_code
    name = code.co_filename.rsplit("/", 1)[-1]
    return Sample(file=code.co_filename, where=f"{code.co_name} ({name}:{frame.f_lineno})",
                  state=fields[0].decode(), cpu=int(fields[11]) + int(fields[12]))


def watch(ident: int, tid: int, leaving: Callable[[], bool], connections_open: Callable[[], int | None],
          report: Callable[[str], None]) -> bool:
    """Watch the training thread (``ident``, kernel thread ``tid``) while ``leaving()`` holds; call
    ``report(why)`` once if it is stuck.

    ``leaving``: the pause is unanswered and the thread runs the user's function.  ``connections_open``:
    the group's TCP connections still open.  Returns whether it reported.  Runs on a helper thread,
    started with the pause; bounded by :data:`BOUND_S`.
    """
    deadline = time.monotonic() + BOUND_S
    first: Sample | None = None
    since = 0.0
    while True:
        time.sleep(_POLL_S)  # first: a worker that leaves at once, the usual case, is never looked at
        if time.monotonic() >= deadline or not leaving():
            return False
        now = sample(ident, tid)
        if now is None or not in_collective(now.file) or connections_open() != 0:
            first = None
        elif first is None or now.where != first.where or now.cpu != first.cpu:
            first, since = now, time.monotonic()
        elif time.monotonic() - since >= GRACE_S and cannot_return(first, now, 0):
            report(f"stuck in {first.where} {GRACE_S:g} s after every connection of its group closed, "
                   "using no CPU: a collective that cannot return (gloo lost a queued send)")
            return True
