"""Workers whose death the agent acted on before the kernel let it reap them.

A SIGKILLed worker runs no more of its code, but it is reaped only once each of its threads has run its
exit and its address space is torn down.  On busy cores, for a thread below normal priority that the agent
may not raise (no ``CAP_SYS_NICE``), that took 68-77 s for a 1 GB worker (docs/benchmarks.md, "Low priority
without CAP_SYS_NICE").  The group records such a death at once and hands the handle here; each later look
reaps what has ended and releases its descriptors.

Example::

    late = LateReaper()
    late.add(handle)        # its death is recorded already
    late.reap()             # at every look: the ended ones are reaped and closed
    late.reap(timeout=5.0)  # as the agent leaves
"""

from __future__ import annotations

import time

from elastrun.agent.workers.starter import WorkerHandle


class LateReaper:
    """The handles of killed workers not yet reaped (see the module docstring)."""

    def __init__(self) -> None:
        self._handles: list[WorkerHandle] = []

    def add(self, handle: WorkerHandle) -> None:
        if handle not in self._handles:
            self._handles.append(handle)

    def __contains__(self, handle: object) -> bool:
        return handle in self._handles

    def __len__(self) -> int:
        return len(self._handles)

    def reap(self, timeout: float = 0.0) -> int:
        """Reap and close every handle whose process has ended, waiting up to ``timeout`` seconds in all for the
        others; how many are left."""
        deadline = time.monotonic() + timeout
        for handle in list(self._handles):
            if handle.wait(max(0.0, deadline - time.monotonic())) is not None:
                handle.close()
                self._handles.remove(handle)
        return len(self._handles)
