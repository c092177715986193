"""A hostile client for the job-token tests: writes forged rendezvous values into a live job.

It plays two strangers.  The *blind* one reaches the store but has no token: it writes the keys
a job without a token would use (``/elastrun/<run_id>/...``).  The *on-path* one also learnt the
job's secret namespace (as if it had read the traffic) but not the token: it writes there,
values without a tag or sealed with another token.  Each writes forged joins (of the current and
the next round), results, ``abort``, dead markers of the real members and heartbeats.
:class:`Forger` is backend-independent; the c10d and etcd tests give it a ``put`` and an ``add``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastrun.observe.events import read_log_dir
from elastrun.rendezvous.api import NodeInfo
from elastrun.rendezvous.auth import TOKEN_ENV, JobAuth, hkdf_sha256
from tests.harness import base_env, read_steps


@dataclass
class TokenJob:
    """The files and environment of a test job run with a job token (the token only in ``token_file``)."""

    token_file: Path
    steps_dir: Path
    log_dir: Path
    env: dict[str, str]
    #: While this file exists the job holds its last step (tests/scripts/steps.py): its checks never
    #: race the job's end.  :func:`assert_job_undisturbed` removes it.
    hold_file: Path


def token_job(tmp_path: Path, token: str, steps: int) -> TokenJob:
    """A private token file, a steps log directory and an environment without ``ELASTRUN_JOB_TOKEN``;
    the job holds its last step until :func:`assert_job_undisturbed`."""
    token_file = tmp_path / "job.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    steps_dir, log_dir = tmp_path / "steps", tmp_path / "logs"
    steps_dir.mkdir()
    hold_file = tmp_path / "hold"
    hold_file.touch()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS=str(steps), STEP_SECONDS="0.05", HOLD_FILE=str(hold_file))
    env.pop(TOKEN_ENV, None)
    return TokenJob(token_file, steps_dir, log_dir, env, hold_file)


class Forger:
    """Writes forged values under ``prefix`` with ``put(key, value)``; ``add(key, n)`` bumps a counter.

    ``tries`` counts the forged writes made.
    """

    def __init__(self, run_id: str, nonce: str, put: Callable[[str, str], None],
                 add: Callable[[str, int], None] | None = None,
                 append: Callable[[str, str], None] | None = None) -> None:
        self.run_id = run_id
        self._put = put
        self._add = add
        self._append = append or put
        # Another token: its tags are well formed but wrong.
        self._wrong = JobAuth(hkdf_sha256(b"not-the-token-" * 3, b"x", b"y"), run_id, nonce)
        self.tries = 0

    def put(self, key: str, value: str, tag: bool) -> None:
        self._put(key, self._wrong.seal(key, value) if tag else value)
        self.tries += 1

    def line(self, key: str, value: str, tag: bool) -> None:
        """Add one line to the list under ``key``."""
        self._append(key, (self._wrong.seal(key, value) if tag else value) + "\n")
        self.tries += 1

    def add(self, key: str, amount: int = 1) -> None:
        if self._add is not None:
            self._add(key, amount)
            self.tries += 1

    def attack(self, prefix: str, round_: int, members: list[str], tag: bool) -> None:
        """One volley of forged writes against round ``round_`` (members ``members``) under ``prefix``."""
        r, nxt = f"{prefix}r{round_}/", f"{prefix}r{round_ + 1}/"
        stranger = NodeInfo("stranger-1-dead", "127.0.0.1", 1, hostname="stranger", pid=1)
        for base, slot in ((r, 99), (nxt, 1), (nxt, 2)):  # joins: the current round and the next one
            self.add(base + "joined")
            self.put(f"{base}node/{slot}", stranger.to_json(), tag)
        self.add(nxt + "rejoined")
        self.put(nxt + "closed", f"1:{stranger.node_id}", tag)
        result = {"members": [{"node_id": stranger.node_id, "addr": "127.0.0.1", "group_rank": 0, "nproc": 1,
                               "rank_offset": 0}], "generation": 7, "restarts_used": 0, "max_restarts": 9,
                  "abort": None, "lost": list(members), "closed_at": 0}
        self.put(nxt + "result", json.dumps(result), tag)
        self.put(nxt + "store", "127.0.0.1:1", tag)
        for node in members:  # dead markers, as a ring watcher writes them
            self.put(f"{r}dead/{node}", "dead:stranger-1-dead", tag)
            self.line(f"{r}gone_list", node, tag)
            self.add(r + "gone")
            self.put(f"{prefix}hb/{node}", "999999:0.0", tag)  # heartbeats
        self.put(f"{prefix}hb/{stranger.node_id}", "1:0.0", tag)
        for node in members:
            self.line(f"{r}done_list", node, tag)
        self.put(prefix + "abort", "job stopped by a stranger", tag)
        self.put(prefix + "abort_code", "3", tag)
        self.put(prefix + "finished", "1", tag)
        self.add(r + "signal", 5)

    def attack_etcd(self, q: str, round_: int, members: list[str], tag: bool) -> None:
        """The same volley in the etcd backend's layout (``q`` = the incarnation's prefix).

        etcd has no heartbeat values (liveness is the agents' leases), so none are forged here.
        """
        r, nxt = f"{q}r{round_}/", f"{q}r{round_ + 1}/"
        stranger = NodeInfo("stranger-1-dead", "127.0.0.1", 1, hostname="stranger", pid=1)
        for base in (r, nxt):  # joins: the current round and the next one
            self.put(f"{base}join/{stranger.node_id}", stranger.to_json(), tag)
        result = {"members": [{"node_id": stranger.node_id, "addr": "127.0.0.1", "group_rank": 0, "nproc": 1,
                               "rank_offset": 0}], "generation": 7, "restarts_used": 0, "max_restarts": 9,
                  "abort": None, "abort_code": 1, "lost": list(members), "closed_at": 0}
        self.put(nxt + "result", json.dumps(result), tag)
        self.put(nxt + "store", "127.0.0.1:1", tag)
        for node in members:  # departures and finishes of the real members
            self.put(f"{r}left/{node}", "stranger says so", tag)
            self.put(f"{r}done/{node}", "1", tag)
        self.put(q + "current", str(round_ + 5), tag)
        self.put(q + "abort", "job stopped by a stranger", tag)
        self.put(q + "abort_code", "3", tag)
        self.put(q + "finished", "1", tag)


def assert_job_undisturbed(nodes: list, job: TokenJob, steps: int, attacked_at: float) -> list[dict]:
    """The nodes exit 0 having run every step once per rank, in one world of 2, in generation 0,
    past the attack, with no restart, loss or failure; returns the agents' events."""
    job.hold_file.unlink()  # the job runs its last step now, after everything the test checked
    for node in nodes:
        assert node.wait(120) == 0, node.output()
    ran = read_steps(job.steps_dir)
    assert sorted((s.rank, s.step) for s in ran) == [(r, i) for r in (0, 1) for i in range(steps)]
    assert {(s.world, s.gen) for s in ran} == {(2, "0")}
    assert max(s.t for s in ran) > attacked_at
    events = read_log_dir(job.log_dir)
    kinds = Counter(e["event"] for e in events)
    assert kinds["round_closed"] == 2 and not kinds["restart"] and not kinds["node_lost"], kinds
    assert not kinds["job_failed"]
    return events
