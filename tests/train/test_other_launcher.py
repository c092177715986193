"""elastrun.train under another launcher (one that sets ``TORCHELASTIC_RUN_ID``, as torchrun does):
memory snapshots survive the launcher's worker restarts, and a later job with the same run id starts
fresh instead of resuming the earlier job's memory.

The launcher here is a small script of the test's own that starts its workers as its children and
restarts them once, as torchrun does.  torchrun itself is not used: its restarts failed 2 runs in 3
under load on this machine (a restarted rank's gloo connect refused), which says nothing about
elastrun.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import free_port

pytestmark = pytest.mark.e2e

SCRIPT = """
import os, torch, torch.distributed as dist
import elastrun.train as et
dist.init_process_group("gloo")
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = et.State(model=model, optimizer=opt, handle_signals=False)
source = state.restore()
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(os.environ["OUT"], "starts"), "a") as f:  # one write per rank: whole lines
    f.write(f"START attempt {attempt} rank {dist.get_rank()} step {state.step} source {source}\\n")
while state.step < 6:
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    state.step += 1
    state.commit()
    if state.step == 4 and attempt == "0" and os.environ.get("CRASH") == "1":
        state.flush()
        os._exit(3)
state.close()
dist.destroy_process_group()
# torch's interpreter teardown can abort after the work is done ("terminate called without an active
# exception": README, teardown).  This test is about restores under another launcher, not torch's exit:
# the script leaves as elastrun's own workers do.
from elastrun.shared.procexit import leave
leave(0)
"""


LAUNCHER = """
import os, subprocess, sys
script, run_id, ports = sys.argv[1], sys.argv[2], sys.argv[3:]
for attempt in range(2):
    env = {**os.environ, "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(attempt),
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ports[attempt]}
    workers = [subprocess.Popen([sys.executable, script], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
               for r in range(2)]
    codes = [w.wait(timeout=100) for w in workers]
    if codes == [0, 0]:
        sys.exit(0)
sys.exit(1)
"""


def _starts(out_dir: Path) -> list[tuple[str, str, int, str]]:
    found = re.findall(r"START attempt (\d+) rank (\d+) step (\d+) source (\S+)", (out_dir / "starts").read_text())
    return sorted((a, r, int(s), src) for a, r, s, src in found)


def _run(cmd: list[str], env: dict[str, str]) -> None:
    env.pop("ELASTRUN_SNAPSHOT_DIR", None)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def _dirs(run_id: str) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"elastrun-snap-{run_id}-*"))


def test_launcher_restart_restores_from_memory_and_a_new_job_starts_fresh(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    run_id = f"other-launcher-{os.getpid()}"
    try:
        # A launcher whose workers crash after committing step 4: its restart reads memory.
        first, second = tmp_path / "first", tmp_path / "second"
        first.mkdir()
        second.mkdir()
        launcher = tmp_path / "launcher.py"
        launcher.write_text(LAUNCHER)
        _run([sys.executable, str(launcher), str(script), run_id, str(free_port()), str(free_port())],
             {**os.environ, "CRASH": "1", "OUT": str(first)})
        assert _starts(first) == [("0", "0", 0, "None"), ("0", "1", 0, "None"),
                                  ("1", "0", 4, "memory"), ("1", "1", 4, "memory")]
        [first_dir] = _dirs(run_id)  # that launcher has exited: its directory stays until swept

        # A later job with the same run id, under another launcher process (here: the test's own).
        env = {**os.environ, "CRASH": "0", "OUT": str(second), "TORCHELASTIC_RUN_ID": run_id,
               "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        _run([sys.executable, str(script)], env)
        assert _starts(second) == [("0", "0", 0, "None")], "a new job resumed the earlier job's memory"
        assert not first_dir.exists(), "the earlier launcher's snapshot directory was not swept"
    finally:
        for d in _dirs(run_id):
            shutil.rmtree(d, ignore_errors=True)
