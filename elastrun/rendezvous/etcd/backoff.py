"""Jittered exponential back-off, for every wait of an agent that found etcd failing or busy.

When one etcd member is overloaded, every agent of a job sees its requests time out, or its
lease expire, at about the same moment.  Retrying at once, or after the same fixed delay, brings
them all back together and keeps etcd overloaded: a write that timed out on the client is still
applied on the server, so each retry adds work, and each re-registration after a lost lease costs
a lease grant and two transactions.  Each wait here doubles, up to a cap, and is drawn at random
from its upper half, so a job's agents spread their retries out and the load falls while etcd
catches up.
"""

from __future__ import annotations

import random


class Backoff:
    """Waits of ``first``, ``2 * first``, ... up to ``cap`` seconds, each drawn from [half, whole]."""

    def __init__(self, first: float, cap: float) -> None:
        self.first, self.cap = first, cap
        self._next = first

    def delay(self) -> float:
        """The next wait (seconds); each call doubles the one after it, up to the cap."""
        whole = self._next
        self._next = min(self.cap, self._next * 2)
        return random.uniform(whole / 2, whole)

    def reset(self) -> None:
        """Start again from ``first`` (after a success)."""
        self._next = self.first
