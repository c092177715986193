"""The agent's own console output: short lines on stderr, prefixed so they stand out from workers'.

Training output belongs to the workers; the agent says one line per round, per failure and per
recovery.  ``--quiet`` keeps only errors; ``--verbose`` adds details (member lists, tracebacks).
The lines go through :mod:`elastrun.shared.log` (the ``elastrun.agent`` logger), like every other
message of elastrun, so ``-q``/``-v`` mean the same for the agent, the pool and the rendezvous.
"""

from __future__ import annotations

from elastrun.shared import log

_log = log.get("agent")


class Console:
    """The agent's messages, as ``elastrun[<node>] <time> <message>`` lines on stderr."""

    def __init__(self, node_id: str, quiet: bool = False, verbose: bool = False) -> None:
        log.configure(quiet, verbose)
        log.set_node(node_id)

    def info(self, message: str, detail: str | None = None) -> None:
        _log.info(f"{message}\n{detail}" if detail and log.verbose() else message)

    def warn(self, message: str) -> None:
        _log.warning(message)

    def error(self, message: str) -> None:
        _log.error(message)

    def debug(self, message: str) -> None:
        _log.debug(message)
