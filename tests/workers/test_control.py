"""The re-form control channel: its typed messages, and both ends over a real Unix socket.

The agent's end (:class:`ControlServer`) and the worker's end (:class:`ControlClient`) run in this
process; a raw socket stands in for the other end where a test sends what elastrun never would.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import time

import pytest

from elastrun.agent.workers.control_server import ControlServer
from elastrun.shared import log
from elastrun.shared.protocol import (
    TO_AGENT,
    TO_WORKER,
    Assign,
    Failed,
    Hello,
    LineReader,
    Pause,
    Paused,
    ProtocolError,
    Reformed,
    encode,
    from_wire,
)
from elastrun.worker.control_client import ControlClient

pytestmark = pytest.mark.unit

EVERY = [Hello(pid=7, local_rank=1), Pause(), Pause(within=5.0), Paused(live=12, pid=7), Paused(live=None, pid=7),
         Paused(live=12, pid=7, at_commit=True),
         Assign(env={"RANK": "3"}, round=4), Reformed(round=4, source="live", step=12, took=0.25, after="x"),
         Failed(error="RuntimeError: boom")]


@pytest.mark.parametrize("message", EVERY, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    accept = TO_AGENT if isinstance(message, TO_AGENT) else TO_WORKER
    assert LineReader(accept).feed(encode(message)) == [message]


@pytest.mark.parametrize(("obj", "why"), [
    ({"type": "resume"}, "unknown control message type 'resume'"),
    ({"pid": 1}, "unknown control message type None"),
    ({"type": "pause"}, "unknown control message type 'pause'"),  # an agent's message, sent to the agent
    ({"type": "hello"}, "'hello' message without its field 'pid'"),
    ({"type": "hello", "pid": "12"}, "field 'pid' must be int"),
    ({"type": "paused", "live": 1.5, "pid": 1}, "field 'live' must be int | None"),
    ({"type": "paused", "live": 1, "pid": 1, "at_commit": 1}, "field 'at_commit' must be bool"),
    ({"type": "failed", "error": "x", "extra": 1}, "unknown field(s) extra"),
    ([1, 2], "must be a JSON object"),
])
def test_malformed_messages_are_refused_with_the_reason(obj, why):
    with pytest.raises(ProtocolError, match=re.escape(why)):
        from_wire(obj, TO_AGENT)


def test_assign_needs_an_environment_of_strings():
    with pytest.raises(ProtocolError, match="field 'env' must be dict"):
        from_wire({"type": "assign", "env": {"RANK": 3}, "round": 1}, TO_WORKER)


def test_reader_reports_lines_that_are_not_json_and_keeps_going():
    got = LineReader(TO_AGENT).feed(b"not json\n" + encode(Failed(error="e")))
    assert isinstance(got[0], ProtocolError) and "not JSON" in str(got[0])
    assert got[1] == Failed(error="e")


# ---------------------------------------------------------------------------------------- both ends
def _until(check, timeout: float = 5.0, pump=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pump is not None:
            pump()
        if check():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def server(tmp_path):
    log.configure()  # warnings reach the console whatever an earlier test set
    srv = ControlServer(tmp_path / "control.sock")
    try:
        yield srv
    finally:
        srv.close()


def test_pause_and_paused_travel_between_the_ends(server):
    got: queue.Queue = queue.Queue()
    client = ControlClient(str(server.path), got.put)
    try:
        client.hello(local_rank=0)
        pid = os.getpid()
        assert _until(lambda: server.connected(pid), pump=lambda: server.pump(0.01))
        assert server.send(pid, Pause())
        assert got.get(timeout=5) == Pause()
        client.send(Paused(live=3, pid=pid))
        assert server.wait_for([pid], (Paused, Failed), 5.0) == {pid: Paused(live=3, pid=pid)}
        assert server.send(pid, Assign(env={"RANK": "1"}, round=2))
        assert got.get(timeout=5) == Assign(env={"RANK": "1"}, round=2)
    finally:
        client.close()


def test_agent_refuses_a_worker_that_sends_an_unknown_message(server, capsys):
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(str(server.path))
    try:
        raw.sendall(encode(Hello(pid=424242, local_rank=0)))
        assert _until(lambda: server.connected(424242), pump=lambda: server.pump(0.01))
        raw.sendall(b'{"type":"resume"}\n')
        assert _until(lambda: not server.connected(424242), pump=lambda: server.pump(0.01))
        err = capsys.readouterr().err
        assert "worker 424242 (local rank 0) sent a control message elastrun does not understand" in err
        assert "unknown control message type 'resume'" in err
        assert raw.recv(16) == b""  # the agent closed the connection
    finally:
        raw.close()


def test_agent_refuses_a_message_before_hello(server, capsys):
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(str(server.path))
    try:
        raw.sendall(encode(Paused(live=None, pid=1)))
        raw.settimeout(5.0)
        assert _until(lambda: "before the connection's 'hello'" in capsys.readouterr().err,
                      pump=lambda: server.pump(0.01))
        assert raw.recv(16) == b""
    finally:
        raw.close()


def test_worker_leaves_the_channel_when_its_agent_sends_a_malformed_message(tmp_path, capfd):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "agent.sock"))
    listener.listen(1)
    got: queue.Queue = queue.Queue()
    client = ControlClient(str(tmp_path / "agent.sock"), got.put)
    conn, _ = listener.accept()
    try:
        client.hello(local_rank=0)
        conn.sendall(encode(Pause()) + b'{"type":"assign","env":["RANK=1"],"round":1}\n')
        assert got.get(timeout=5) == Pause()
        assert got.get(timeout=5) is None  # as if the agent had closed the channel: no re-form, a restart
        assert "field 'env' must be dict[str, str]" in capfd.readouterr().err
    finally:
        client.close()
        conn.close()
        listener.close()


def test_an_answer_that_came_in_time_counts_even_if_the_agent_reads_it_late(server):
    """The agent's wait for a pause's answers ends with a look at what its sockets hold: an agent
    that did not run for the whole bound (a busy host) still keeps the worker that answered."""
    client = ControlClient(str(server.path), lambda message: None)
    try:
        client.hello(local_rank=0)
        pid = os.getpid()
        assert _until(lambda: server.connected(pid), pump=lambda: server.pump(0.01))
        client.send(Paused(live=3, pid=pid))  # in the socket, not read yet: the bound is already spent
        assert server.wait_for([pid], (Paused, Failed), 0.0) == {pid: Paused(live=3, pid=pid)}
        assert server.wait_for([pid], (Paused, Failed), 0.0) == {}  # and nothing is made up
    finally:
        client.close()
