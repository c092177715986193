"""A small metrics registry (counters, gauges, timings) fed by the agent's events.

Runs in: the agent.

The agent never updates metrics directly: :class:`EventMetrics` listens to the
:class:`~elastrun.observe.events.EventLog` and turns each event into counter increments, gauge
values and timing observations.  So the event log and the metrics cannot disagree, and adding a
metric never touches the agent.  :meth:`Registry.render` writes Prometheus' text exposition
format (version 0.0.4), which :mod:`elastrun.observe.server` serves over HTTP.

Metric names and what feeds them are listed in docs/observe.md.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

Labels = tuple[tuple[str, str], ...]


def _label_key(labels: dict[str, Any]) -> Labels:
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


class _Metric:
    """Common part of the three kinds: a name, a help text and values per label set."""

    kind = ""

    def __init__(self, name: str, help_text: str, lock: threading.Lock, const_labels: Labels) -> None:
        self.name = name
        self.help = help_text
        self._lock = lock
        self._const = const_labels
        self._values: dict[Labels, Any] = {}

    def _key(self, labels: dict[str, Any]) -> Labels:
        return tuple(sorted(self._const + _label_key(labels)))

    def samples(self) -> list[tuple[str, Labels, float]]:
        """``(sample name, labels, value)`` rows, as the text format lists them."""
        with self._lock:
            return [(self.name, key, float(value)) for key, value in sorted(self._values.items())]

    def value(self, **labels: Any) -> Any:
        """The current value for ``labels`` (None when never set); for tests and embedding code."""
        with self._lock:
            return self._values.get(self._key(labels))


class Counter(_Metric):
    """A value that only goes up (events seen, failures, restarts)."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot go down (inc by {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Metric):
    """A value that goes up and down (world size, running workers, round number)."""

    kind = "gauge"

    def set(self, value: float, **labels: Any) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Timing(_Metric):
    """Durations in seconds: a Prometheus summary (``_count``, ``_sum``) plus ``_max``/``_last`` gauges."""

    kind = "summary"

    def observe(self, seconds: float, **labels: Any) -> None:
        key = self._key(labels)
        with self._lock:
            count, total, largest, _ = self._values.get(key, (0, 0.0, 0.0, 0.0))
            self._values[key] = (count + 1, total + seconds, max(largest, seconds), seconds)

    def samples(self) -> list[tuple[str, Labels, float]]:
        rows = []
        with self._lock:
            for key, (count, total, _largest, _last) in sorted(self._values.items()):
                rows.append((self.name + "_count", key, float(count)))
                rows.append((self.name + "_sum", key, float(total)))
        return rows

    def extra_gauges(self) -> list[tuple[str, Labels, float]]:
        """``<name>_max`` and ``<name>_last``: the text format has no place for them in a summary."""
        rows = []
        with self._lock:
            for key, (_count, _total, largest, last) in sorted(self._values.items()):
                rows.append((self.name + "_max", key, float(largest)))
                rows.append((self.name + "_last", key, float(last)))
        return rows


class Registry:
    """Holds named metrics and renders them; ``const_labels`` (e.g. node, run id) go on every sample."""

    def __init__(self, const_labels: dict[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}
        self._const = _label_key(const_labels or {})
        self._collectors: list[Callable[[Registry], None]] = []

    def add_collector(self, collect: Callable[[Registry], None]) -> None:
        """Call ``collect(registry)`` before each :meth:`render`: metrics computed when scraped (goodput)."""
        self._collectors.append(collect)

    def _get(self, cls: type, name: str, help_text: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            metric = cls(name, help_text, self._lock, self._const)
            self._metrics[name] = metric
        elif not isinstance(metric, cls):
            raise ValueError(f"metric {name} is a {metric.kind}, not a {cls.kind}")
        return metric

    def counter(self, name: str, help_text: str) -> Counter:
        """The counter ``name`` (created on first use; Prometheus convention: ends in ``_total``)."""
        return self._get(Counter, name, help_text)

    def gauge(self, name: str, help_text: str) -> Gauge:
        return self._get(Gauge, name, help_text)

    def timing(self, name: str, help_text: str) -> Timing:
        """Durations in seconds (name them ``..._seconds``)."""
        return self._get(Timing, name, help_text)

    def get(self, name: str) -> _Metric | None:
        return self._metrics.get(name)

    def render(self) -> str:
        """Every metric in Prometheus' text exposition format (0.0.4)."""
        for collect in list(self._collectors):
            try:
                collect(self)
            except Exception as exc:  # a scrape must answer even when a collector fails
                from elastrun.shared import log

                log.get("observe").debug(f"metrics collector failed: {exc}")
        out: list[str] = []
        for name in sorted(self._metrics):
            metric = self._metrics[name]
            out.append(f"# HELP {name} {metric.help}")
            out.append(f"# TYPE {name} {metric.kind}")
            out.extend(f"{s}{_format_labels(lab)} {_format_value(v)}" for s, lab, v in metric.samples())
            if isinstance(metric, Timing):
                for suffix, what in (("_max", "longest"), ("_last", "latest")):
                    rows = [r for r in metric.extra_gauges() if r[0].endswith(suffix)]
                    out.append(f"# HELP {name}{suffix} The {what} observation of {name}.")
                    out.append(f"# TYPE {name}{suffix} gauge")
                    out.extend(f"{s}{_format_labels(lab)} {_format_value(v)}" for s, lab, v in rows)
        return "\n".join(out) + "\n"


class EventMetrics:
    """An EventLog listener that keeps a :class:`Registry` up to date from the agent's events.

    Use: ``events.add_listener(EventMetrics(registry))``.  Called from whichever thread emits.
    """

    def __init__(self, registry: Registry) -> None:
        r = registry
        self.registry = r
        self.events = r.counter("elastrun_events_total", "Events emitted by this agent, by kind.")
        self.rounds = r.counter("elastrun_rounds_total", "Rendezvous rounds this node was a member of.")
        self.worker_starts = r.counter("elastrun_worker_starts_total", "Worker processes started.")
        self.worker_exits = r.counter(
            "elastrun_worker_exits_total", "Workers that exited on their own, by outcome (ok, error)."
        )
        self.failures = r.counter("elastrun_worker_failures_total", "Worker-group failures on this node.")
        self.restarts = r.counter(
            "elastrun_restarts_total", "Worker-group restarts of this node, by cause (failure, membership)."
        )
        self.nodes_lost = r.counter("elastrun_nodes_lost_total", "Nodes this agent saw declared lost.")
        self.hangs = r.counter("elastrun_hangs_total", "Worker hangs detected (--hang-timeout).")
        self.recoveries = r.counter("elastrun_recoveries_total", "Workers running again after a fault.")
        self.round = r.gauge("elastrun_round", "Number of the rendezvous round this node is in.")
        self.generation = r.gauge("elastrun_generation", "Worker-group generation (RESTART_COUNT).")
        self.world = r.gauge("elastrun_world_size", "Workers in the job (WORLD_SIZE) in the current round.")
        self.nodes = r.gauge("elastrun_nodes", "Nodes in the current round (GROUP_WORLD_SIZE).")
        self.group_rank = r.gauge("elastrun_group_rank", "This node's group rank in the current round.")
        self.running = r.gauge("elastrun_workers_running", "Local worker processes running now.")
        self.used = r.gauge("elastrun_restarts_used", "Restarts of the job's budget spent (job-wide).")
        self.budget = r.gauge("elastrun_restarts_max", "The job's restart budget (--max-restarts).")
        self.up_since = r.gauge("elastrun_agent_start_timestamp_seconds", "Unix time the agent started.")
        self.last_event = r.gauge("elastrun_last_event_timestamp_seconds", "Unix time of the latest event.")
        self.exited = r.gauge("elastrun_agent_exit_code", "The agent's exit code, once it is exiting.")
        self.rdzv_time = r.timing("elastrun_rendezvous_seconds", "Time from joining a round to its closing.")
        self.recovery_time = r.timing(
            "elastrun_recovery_seconds", "Time from a fault's detection to all local workers started again."
        )
        self.detection_time = r.timing(
            "elastrun_node_loss_detection_seconds", "Time from a node's silence to its loss being declared."
        )
        for counter in (self.rounds, self.worker_starts, self.failures, self.nodes_lost, self.hangs, self.recoveries):
            counter.inc(0)  # present from the start, so rate() and alerts see a 0 rather than nothing
        self._running: set[Any] = set()
        self._pending_cause = ""

    def __call__(self, event: dict[str, Any]) -> None:
        kind = str(event.get("event", ""))
        self.events.inc(event=kind)
        self.last_event.set(float(event.get("ts", 0.0)))
        handler = getattr(self, "_on_" + kind, None)
        if handler is not None:
            handler(event)

    def _on_agent_start(self, e: dict[str, Any]) -> None:
        self.up_since.set(float(e["ts"]))
        self.running.set(0)

    def _on_round_closed(self, e: dict[str, Any]) -> None:
        self.rounds.inc()
        self.round.set(e.get("round", 0))
        self.generation.set(e.get("generation", 0))
        self.world.set(e.get("world_size", 0))
        self.nodes.set(e.get("group_world_size", len(e.get("members", []))))
        self.group_rank.set(e.get("group_rank", 0))
        self.used.set(e.get("restarts_used", 0))
        self.budget.set(e.get("max_restarts", 0))
        if e.get("duration") is not None:
            self.rdzv_time.observe(float(e["duration"]))
        if self._pending_cause:
            self.restarts.inc(cause=self._pending_cause)
            self._pending_cause = ""

    def _on_worker_start(self, e: dict[str, Any]) -> None:
        self.worker_starts.inc()
        self._running.add(e.get("pid"))
        self.running.set(len(self._running))

    def _on_worker_exit(self, e: dict[str, Any]) -> None:
        ok = e.get("exitcode") == 0 and not e.get("signal")
        self.worker_exits.inc(outcome="ok" if ok else "error")
        self._running.discard(e.get("pid"))
        self.running.set(len(self._running))

    def _on_worker_failure(self, _e: dict[str, Any]) -> None:
        self.failures.inc()
        self._pending_cause = "failure"
        self._stopped()

    def _on_hang_detected(self, _e: dict[str, Any]) -> None:
        self.hangs.inc()

    def _on_restart(self, _e: dict[str, Any]) -> None:
        if not self._pending_cause:
            self._pending_cause = "membership"
        self._stopped()

    def _on_round_start(self, _e: dict[str, Any]) -> None:
        self._stopped()

    def _stopped(self) -> None:
        # The agent kills the whole local group before it goes round again (no exit events for those).
        self._running.clear()
        self.running.set(0)

    def _on_node_lost(self, e: dict[str, Any]) -> None:
        self.nodes_lost.inc(len(e.get("lost") or []) or 1)
        if e.get("detection") is not None:
            self.detection_time.observe(float(e["detection"]))

    def _on_recovered(self, e: dict[str, Any]) -> None:
        self.recoveries.inc()
        if e.get("duration") is not None:
            self.recovery_time.observe(float(e["duration"]))

    def _on_agent_exit(self, e: dict[str, Any]) -> None:
        self.exited.set(e.get("exitcode", 0))
        self._stopped()


class GoodputMetrics:
    """A collector (``registry.add_collector(GoodputMetrics(tracker))``): goodput so far, at each scrape.

    Gauges, not counters: a step counted as goodput becomes badput when a later fault rolls it back.
    Recomputed at most every ``min_interval`` seconds (the step records are re-read each time).
    """

    def __init__(self, tracker: Any, min_interval: float = 5.0) -> None:
        self.tracker = tracker
        self.min_interval = min_interval
        self._last = -float("inf")

    def __call__(self, r: Registry) -> None:
        if time.monotonic() - self._last < self.min_interval:
            return
        self._last = time.monotonic()
        gp = self.tracker.compute()
        if gp is None:
            return
        from elastrun.observe.goodput import CAUSES

        ratio = r.gauge("elastrun_goodput_ratio",
                        "Share of this node's worker-seconds spent in committed steps never redone (so far).")
        wall = r.gauge("elastrun_goodput_wall_ratio", "Share of wall time in which a kept step ran (so far).")
        good = r.gauge("elastrun_goodput_seconds", "Worker-seconds in committed steps never redone (so far).")
        bad = r.gauge("elastrun_badput_seconds", "Worker-seconds of badput by cause (so far; docs/observe.md).")
        ratio.set(gp.ratio if gp.ratio is not None else float("nan"))
        wall.set(gp.wall_ratio if gp.wall_ratio is not None else float("nan"))
        good.set(gp.good)
        for cause in CAUSES:
            bad.set(gp.badput.get(cause, 0.0), cause=cause)
