"""How a killed CUDA worker dies, and what its replacement could do meanwhile (``bench_gpu.py --teardown``).

A worker crash reached its next step 2.1-2.7 s after the kill on an H100, against issue 32's 2 s;
about 1 s of that passed before the agent could see the exit: the kernel releasing the dead
process's page-locked slots (12 GB of them for the 336M model).  This measures the pieces a faster
restart would be built from, for one device call to decide between them:

* **how the process dies**: from the SIGKILL, when its socket reads end-of-file (its descriptors
  closed, early in the kernel's teardown), when its device memory is free again, and when it is
  reaped (what the agent waits for today);
* **a replacement started at the kill** (``overlap``): a process that has imported torch already (as
  a worker forked from the agent's template has) is told to go at the kill; when it has a CUDA
  context, and when it holds as much device memory as the dead one did.  If that comes well before
  the reap, a restart begun at the first sign of death (the closed descriptors, ``PF_EXITING``)
  would save that time; if the driver makes it wait for the teardown, it would not;
* **the page size** (``kind``): the slots as ``State`` makes them (``/dev/shm`` files, 4 KiB pages),
  or shared memory asking for transparent huge pages (``memfd_create`` and ``MADV_HUGEPAGE``, as far
  as the host's ``shmem_enabled`` lets it), with the seconds their page-locking took.  Registering
  and releasing page-locked memory both go page by page: 2 MiB pages could cut both (issue 32, items
  4 and 5).  ``huge_kib`` says how much of the slots huge pages actually backed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")

#: The dying process: device memory, three slots of page-locked memory, then "ready" and its figures.
_DYING = r"""
import json, mmap, os, sys, time
from pathlib import Path
fd, device_gb, pinned_gb, kind = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[5]
where = Path(sys.argv[4])
import torch
from elastrun.train.slotmem import SlotMemory, address
torch.cuda.set_device(0)
held = torch.empty(int(device_gb * 1e9), dtype=torch.uint8, device="cuda").fill_(1)
size = int(pinned_gb * 1e9 / 3)
slots, pin_s = [], 0.0
for i in range(3 if pinned_gb else 0):
    if kind == "shm":
        mem = SlotMemory(where / f"slot{i}", size, ready=True)
        at = address(mem.mm)
    else:  # shared memory asking for huge pages, every page faulted in before it is page-locked
        m = os.memfd_create(f"slot{i}")
        os.ftruncate(m, size)
        mem = mmap.mmap(m, size, flags=mmap.MAP_SHARED)
        mem.madvise(mmap.MADV_HUGEPAGE)
        zeros = bytes(64 << 20)
        for off in range(0, size, len(zeros)):
            mem[off:off + len(zeros)] = memoryview(zeros)[:size - off]
        at = address(mem)
    began = time.monotonic()
    if int(torch.cuda.cudart().cudaHostRegister(at, size, 1)) != 0:
        raise SystemExit("cudaHostRegister refused")
    pin_s += time.monotonic() - began
    slots.append(mem)
huge = sum(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("ShmemPmdMapped"))
torch.cuda.synchronize()
os.write(fd, json.dumps({"pin_s": round(pin_s, 3), "huge_kib": huge}).encode())
time.sleep(600)
"""

#: The replacement: torch imported (as a forked worker has it), then at "go" a context and the memory.
_NEXT = r"""
import json, sys, time
device_gb = float(sys.argv[1])
import torch
print("imported", flush=True)
sys.stdin.readline()
marks = {"went": time.monotonic()}
torch.cuda.set_device(0)
torch.empty(1, device="cuda")
marks["context"] = time.monotonic()
held = torch.empty(int(device_gb * 1e9), dtype=torch.uint8, device="cuda").fill_(1)
torch.cuda.synchronize()
marks["allocated"] = time.monotonic()
print(json.dumps(marks), flush=True)
"""


def shmem_policy() -> str:
    """The host's policy for huge pages in shared memory (``[advise]`` and the like), or ``unknown``."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    except OSError:
        return "unknown"


def teardown(pinned_gb: float, kind: str = "shm", device_gb: float = 20.0) -> dict:
    """One dying process of ``device_gb`` of device memory and ``pinned_gb`` of page-locked slots of
    ``kind`` (``shm`` or ``huge``), SIGKILLed; with a replacement told to go at the kill.  Seconds from
    the kill (see the module docstring)."""
    mine, theirs = socket.socketpair()
    where = Path(tempfile.mkdtemp(prefix="bench-dying-", dir=SHM))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", _DYING, str(theirs.fileno()), str(device_gb), str(pinned_gb),
                             str(where), kind], pass_fds=[theirs.fileno()], env=env)  # fmt: skip
    theirs.close()
    nxt = subprocess.Popen([sys.executable, "-c", _NEXT, str(device_gb)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    out: dict = {"pinned_gb": pinned_gb, "kind": kind, "device_gb": device_gb}
    try:
        mine.settimeout(120)
        out.update(json.loads(mine.recv(4096)))
        if nxt.stdout is None or nxt.stdout.readline().strip() != "imported":
            raise RuntimeError("the replacement did not import torch")
        eof: list[float] = []
        freed: list[float] = []
        held = torch.cuda.mem_get_info()[0]  # free device memory while it lives (this process's context made)
        t = time.monotonic()

        def read_eof() -> None:
            mine.recv(16)
            eof.append(time.monotonic() - t)

        def watch_memory() -> None:  # when its device memory is free again (a replacement may need it)
            while time.monotonic() - t < 30:
                if torch.cuda.mem_get_info()[0] - held >= 0.9 * device_gb * 1e9:
                    freed.append(time.monotonic() - t)
                    return
                time.sleep(0.002)

        watchers = [threading.Thread(target=fn, daemon=True) for fn in (read_eof, watch_memory)]
        for w in watchers:
            w.start()
        os.kill(proc.pid, signal.SIGKILL)
        if nxt.stdin is not None:
            nxt.stdin.write("go\n")
            nxt.stdin.flush()
        proc.wait(timeout=60)
        out["reaped_s"] = time.monotonic() - t
        for w in watchers:
            w.join(timeout=60)
        out["eof_s"] = eof[0] if eof else None
        out["device_memory_free_s"] = freed[0] if freed else None
        marks = json.loads(nxt.communicate(timeout=120)[0].strip().splitlines()[-1])
        out["overlap"] = {k: round(v - t, 3) for k, v in marks.items()}
    except Exception as e:  # reported, the rest goes on
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        for p in (proc, nxt):
            p.kill()
            p.wait(timeout=60)
        mine.close()
        shutil.rmtree(where, ignore_errors=True)
    return out


def teardowns() -> dict:
    """Without page-locked memory; with 12 GB of it as ``State`` makes it; and with huge pages."""
    return {"shmem_enabled": shmem_policy(),
            "runs": [teardown(0.0), teardown(12.0), teardown(12.0, "huge")]}  # fmt: skip
