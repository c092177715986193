"""What this host offers workers, probed without importing torch: GPUs, CPUs, the torch build.

The command line reads these to turn ``--nproc-per-node=auto|cpu|gpu`` into a number before
anything starts; they are cheap (a glob, a file read, one ``nvidia-smi`` call at most) so that
``elastrun --help`` and a mistaken flag never pay for loading torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping


def count_gpus(environ: Mapping[str, str]) -> int:
    """NVIDIA GPUs a worker may use: device nodes (else ``nvidia-smi -L``), capped by CUDA_VISIBLE_DEVICES."""
    import glob

    found = sum(1 for path in glob.glob("/dev/nvidia[0-9]*") if path[len("/dev/nvidia") :].isdigit())
    if not found:
        import shutil
        import subprocess

        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                listing = ""
            found = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    listed = 0
    for item in visible.split(","):
        if not item.strip() or item.strip().startswith("-"):
            break  # like CUDA: the list ends at the first invalid entry
        listed += 1
    return min(found, listed)


def torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build, read from its version.py without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as handle:
                match = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(.+)$", handle.read(), re.MULTILINE)
        except OSError:
            continue
        return bool(match) and match.group(1).strip() != "None"
    return False


def cpu_count() -> int:
    """CPUs this process may run on (respects taskset/cgroup affinity, as torchrun does)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
