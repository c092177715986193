"""The metrics registry's text format, and the endpoint of a live agent started with --metrics-port."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from elastrun.config import LaunchConfig
from elastrun.observe import start_observability
from elastrun.observe.events import EventLog
from elastrun.observe.metrics import Registry
from elastrun.shared import log as console_log
from tests.harness import REPO, base_env, free_port, wait_until

pytestmark = pytest.mark.unit

AGENT_SOURCE = REPO / "elastrun" / "agent" / "agent.py"


def test_registry_renders_prometheus_text_with_escaped_labels() -> None:
    r = Registry({"node": 'a"b\\c\nd'})
    r.counter("x_total", "Things.").inc(2, kind="k")
    r.gauge("y", "A level.").set(1.5)
    t = r.timing("z_seconds", "Durations.")
    t.observe(0.5)
    t.observe(1.5)
    text = r.render()
    assert '# TYPE x_total counter\nx_total{kind="k",node="a\\"b\\\\c\\nd"} 2\n' in text
    assert 'y{node="a\\"b\\\\c\\nd"} 1.5' in text
    assert "# TYPE z_seconds summary" in text and 'z_seconds_count{node="a\\"b\\\\c\\nd"} 2' in text
    assert 'z_seconds_sum{node="a\\"b\\\\c\\nd"} 2' in text and 'z_seconds_max{node="a\\"b\\\\c\\nd"} 1.5' in text
    with pytest.raises(ValueError):
        r.counter("x_total", "").inc(-1)
    with pytest.raises(ValueError):
        r.gauge("x_total", "")


def test_taken_port_warns_and_the_agent_runs_on(capsys) -> None:
    console_log.configure()  # the default console level (an earlier test in this process may have set -q)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        log = EventLog("n")
        handle = start_observability(LaunchConfig(entrypoint="x", metrics_port=port), log)
        log.emit("worker_start", pid=1)
        handle.close(log)
    assert handle.metrics_url is None
    assert f"cannot serve metrics on 127.0.0.1:{port}" in capsys.readouterr().err
    assert handle.registry.get("elastrun_worker_starts_total").value() == 1


def _scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.read().decode()
    except (urllib.error.URLError, OSError):
        return None


@pytest.mark.e2e
@pytest.mark.skipif("start_observability" not in AGENT_SOURCE.read_text(),
                    reason="the agent does not call start_observability yet")
def test_live_agent_serves_metrics(agents, tmp_path) -> None:
    port = free_port()
    env = base_env(STEPS_LOG=str(tmp_path), STEPS="100000", STEP_SECONDS="0.05")
    agents.start(["--standalone", "--nproc-per-node=2", f"--metrics-port={port}"], env=env)
    url = f"http://127.0.0.1:{port}/metrics"

    def running_two():
        text = _scrape(url)
        return text if text and _line(text, "elastrun_workers_running").endswith("} 2") else None

    text = wait_until(running_two, 60, interval=0.3, what="the endpoint to report 2 running workers")
    assert "elastrun_rounds_total{" in text and _line(text, "elastrun_rounds_total").endswith("} 1")
    assert _line(text, "elastrun_world_size").endswith("} 2")
    assert _line(text, "elastrun_worker_starts_total").endswith("} 2")


def _line(text: str, name: str) -> str:
    return next((line for line in text.splitlines() if line.startswith(name + "{")), "")
