"""Seeing a job: the event log, metrics, ``elastrun status`` and ``elastrun timeline``.

Runs in: the agent (:func:`start_observability`); the CLI imports the package for its submodules.

The agent calls :func:`start_observability` once, right after it creates its
:class:`~elastrun.observe.events.EventLog`, and ``close()`` on the handle when it exits.  Nothing
here imports torch; the status reader and the plotting code are imported only by the
subcommands that need them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from elastrun.shared import log

if TYPE_CHECKING:
    from elastrun.config import LaunchConfig
    from elastrun.observe.events import EventLog
    from elastrun.observe.goodput_report import GoodputTracker
    from elastrun.observe.metrics import Registry
    from elastrun.observe.server import MetricsServer

#: Environment variable naming the address the metrics endpoint binds (default 127.0.0.1).
METRICS_HOST_ENV = "ELASTRUN_METRICS_HOST"


class Observability:
    """What :func:`start_observability` started: the metrics registry and, with a port, its HTTP server."""

    def __init__(self, registry: Registry, server: MetricsServer | None, listener, goodput: GoodputTracker) -> None:
        self.registry = registry
        self.server = server
        self._listener = listener
        #: This node's goodput so far (``goodput.summary_line()`` is the agent's end-of-job line).
        self.goodput = goodput

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics``, or None when no endpoint is served."""
        return self.server.url if self.server is not None else None

    def close(self, events: EventLog | None = None) -> None:
        """Stop the HTTP server (if any); pass the EventLog to also detach the metrics listener."""
        if events is not None:
            events.remove_listener(self._listener)
            events.remove_listener(self.goodput)
        if self.server is not None:
            self.server.close()
            self.server = None


def start_observability(config: LaunchConfig, events: EventLog) -> Observability:
    """Attach the metrics registry to ``events`` and, if ``config.metrics_port`` is set, serve it.

    The endpoint binds ``$ELASTRUN_METRICS_HOST`` (default 127.0.0.1) on ``config.metrics_port``
    (0 picks a free port; see ``handle.metrics_url``).  A port that cannot be bound is reported on
    stderr and the agent runs on without an endpoint: metrics must never stop a training job.
    """
    from elastrun.observe.goodput_report import GoodputTracker
    from elastrun.observe.metrics import EventMetrics, GoodputMetrics, Registry

    registry = Registry({"node": events.node_id, "run_id": config.run_id})
    listener = EventMetrics(registry)
    events.add_listener(listener)
    goodput = GoodputTracker([Path(config.log_dir)] if config.log_dir else [])
    events.add_listener(goodput)
    registry.add_collector(GoodputMetrics(goodput))
    server = None
    if config.metrics_port is not None:
        from elastrun.observe.server import MetricsServer

        host = os.environ.get(METRICS_HOST_ENV, "").strip() or "127.0.0.1"
        try:
            server = MetricsServer(registry.render, host, int(config.metrics_port))
        except OSError as exc:
            log.get("observe").warning(
                f"cannot serve metrics on {host}:{config.metrics_port} ({exc}); "
                "the job runs without a metrics endpoint"
            )
    return Observability(registry, server, listener, goodput)


__all__ = ["METRICS_HOST_ENV", "Observability", "start_observability"]
