"""The ``c10d`` rendezvous backend and ``static``, its fixed-membership variant: rounds on torch's ``TCPStore``.

Runs in: the agent; the status reader (:mod:`~elastrun.rendezvous.c10d.status`) in the CLI (``elastrun status``).

- :mod:`~elastrun.rendezvous.c10d.handler`: the backend's settings and factory, a member's side of a
  round (:class:`StoreRendezvousHandler`, :data:`BACKEND`);
- :mod:`~elastrun.rendezvous.c10d.closing`: the wait for a round's close, the close, its result and
  the pruning of old rounds;
- :mod:`~elastrun.rendezvous.c10d.liveness`: heartbeats, the ring watch, the liveness link;
- :mod:`~elastrun.rendezvous.c10d.seats`: a large round's result in pieces;
- :mod:`~elastrun.rendezvous.c10d.client`: connecting to (or hosting) the store, and its operations;
- :mod:`~elastrun.rendezvous.c10d.status`: ``elastrun status``'s reader of the store;
- :mod:`~elastrun.rendezvous.c10d.static`: the ``static`` backend (fixed nodes and ranks).

The keys written and the order of operations are documented in docs/rendezvous-protocol.md.
"""

from __future__ import annotations

from elastrun.rendezvous.c10d.handler import (
    BACKEND,
    StoreRendezvousHandler,
    create_handler,
    parse_config,
    validate_params,
)

__all__ = ["BACKEND", "StoreRendezvousHandler", "create_handler", "parse_config", "validate_params"]
