"""A node that joins a job that trains finishes its own start-up first, then joins.

A joiner's agent reaches the rendezvous right after its own ``import torch``, while the warm pool's
template still imports the rest of what a worker needs (``torch._dynamo``, ``--preload``): about
1.4 s on this project's test machine.  Joined at once, it stops every member's workers at once, and
they all stand still until the joiner has a worker to start.  So before its first round the agent
asks the rendezvous whether its join would stop a group that trains
(:meth:`~elastrun.rendezvous.api.RendezvousHandler.join_interrupts`), and while it would, waits for
its starter to be ready (:meth:`~elastrun.agent.workers.starter.WorkerStarter.ready_fileno`), asking
again every :data:`POLL` seconds.  It joins at once when a round starts forming meanwhile (after a
fault such a round closes as soon as the last members are back: a node that waits would miss it
and stop the new group once more), and after :data:`LIMIT` in any case (a ``--preload`` that hangs
costs the members what joining at once would have).
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Seconds between two questions to the rendezvous while a join is deferred (a few reads each).
POLL = 0.05
#: The longest a join is deferred, in seconds.
LIMIT = 60.0


@dataclass
class Deferral:
    """A join that waited: for how long, and what ended the wait (``ready``: the node's workers can
    start; ``round forming``; ``limit``; ``rendezvous error``: the join reports it)."""

    waited: float
    ended_by: str


def defer_join(
    interrupts: Callable[[], bool],
    ready_fd: int | None,
    on_wait: Callable[[], None] = lambda: None,
    poll: float = POLL,
    limit: float = LIMIT,
) -> Deferral | None:
    """Wait, before a first join, while joining would stop a group that trains and ``ready_fd`` (readable
    once this node's workers can start) is not readable.  None: joining at once was right.

    ``on_wait`` is called once, when the wait begins.
    """
    if ready_fd is None or _readable(ready_fd, 0.0) or not _asks(interrupts):
        return None
    on_wait()
    started = time.monotonic()
    while True:
        left = started + limit - time.monotonic()
        if left <= 0:
            return Deferral(time.monotonic() - started, "limit")
        if _readable(ready_fd, min(poll, left)):
            return Deferral(time.monotonic() - started, "ready")
        try:
            if not interrupts():
                return Deferral(time.monotonic() - started, "round forming")
        except Exception:  # noqa: BLE001 - see _asks
            return Deferral(time.monotonic() - started, "rendezvous error")


def _asks(interrupts: Callable[[], bool]) -> bool:
    """The rendezvous' answer; False when it gives none.  The wait only saves the members time, so any
    error (a backend's own, not only a :class:`RendezvousError`) means joining at once: the join that
    follows reports what is wrong."""
    try:
        return interrupts()
    except Exception:  # noqa: BLE001
        return False


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])
