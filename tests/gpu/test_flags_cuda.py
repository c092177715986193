"""``commit()``'s flags under NCCL: all-reduced over the host, without waiting for the GPU.

Under an NCCL default group the flags used to be all-reduced on the GPU and read back on the host,
which waited for every kernel the training stream had queued.  Here a kernel that keeps the GPU busy
for about two seconds is queued, then ``maxima`` runs (as at world size > 1: ``active`` says yes): it
must return while that kernel still runs, through a gloo group made beside the NCCL one.  The old
route is timed beside it, so the test shows that it would fail had the flags stayed on the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.gpu.conftest import gpus
from tests.train.harness import env

pytestmark = pytest.mark.e2e

_JOB = r"""
import json, time
import torch, torch.distributed as dist
from elastrun.train import dist as edist

dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
edist.active = lambda: True  # world size 1: maxima would return at once; take its multi-rank route
torch.cuda.synchronize()

def busy():  # one kernel of 4e9 GPU clock cycles on the training stream: about two seconds on an H100
    torch.cuda._sleep(4_000_000_000)

busy()
t = time.perf_counter()
got = edist.maxima((1, 0, 7), [])
host_s = time.perf_counter() - t
still_busy = not torch.cuda.current_stream().query()
torch.cuda.synchronize()
group = edist.flag_group()
busy()
t = time.perf_counter()
flags = torch.tensor([1, 0, 7], device="cuda")
dist.all_reduce(flags, op=dist.ReduceOp.MAX)
flags.tolist()  # the old route: read back on the host
old_s = time.perf_counter() - t
print(json.dumps({"got": list(got), "host_s": host_s, "still_busy": still_busy, "old_s": old_s,
                  "backend": str(dist.get_backend(group))}))
dist.destroy_process_group()
"""


@gpus(1)
def test_flags_under_nccl_do_not_wait_for_the_gpu():
    proc = subprocess.run([sys.executable, "-c", _JOB], env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["got"] == [1, 0, 7] and report["backend"] == "gloo", report
    assert report["old_s"] > 1.0, f"the GPU kernel that should keep the GPU busy did not: {report}"
    assert report["still_busy"] and report["host_s"] < 0.5, f"the flags waited for the GPU: {report}"
