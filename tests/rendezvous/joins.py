"""Handlers joining rounds on threads of their own, as the agents of several nodes would.

Used by the tests that arrange who joins a round when (a closer's decision window): each call of
:meth:`Joins.start` runs one handler's ``next_round`` on a daemon thread and keeps what it returned,
keyed by (round, node index), or what it raised.
"""

from __future__ import annotations

import threading

from elastrun.rendezvous.api import NodeInfo, RendezvousHandler


class Joins:
    """``handlers[i]`` joins as ``infos[i]``; ``results[(round, i)]`` and ``errors`` fill as they end."""

    def __init__(self, handlers: list[RendezvousHandler], infos: list[NodeInfo]) -> None:
        self.handlers, self.infos = handlers, infos
        self.results: dict[tuple[int, int], object] = {}
        self.errors: list[BaseException] = []

    def start(self, i: int, round_: int) -> threading.Thread:
        """Node ``i`` joins (the round it expects is ``round_``, the key of its result); its thread."""

        def body() -> None:
            try:
                self.results[(round_, i)] = self.handlers[i].next_round(self.infos[i])
            except BaseException as exc:  # noqa: BLE001 - the tests assert on errors
                self.errors.append(exc)

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread
