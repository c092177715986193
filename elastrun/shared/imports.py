"""Importing torch (and the modules it brings) with the cyclic garbage collector paused.

Runs in: the agent (its ``torch.distributed``), the warm pool's template (its base and ``--preload``
imports) and the ``elastrun status`` tool.

``import torch`` creates hundreds of thousands of objects that live as long as the process.  While
they are created, the collector runs again and again (each run of the oldest generation walks every
object made so far) and finds almost nothing to free: on 2 cores, ``torch``, ``torch.distributed``,
``torch._dynamo`` and the DDP path, then one full collection, took 2.8-4.0 CPU-s with it running and
2.2-3.5 CPU-s with it paused (docs/benchmarks.md, "Imports with the collector paused").  Reference
counting frees what it always frees meanwhile, and the few cycles left behind go at the next
collection.  With the agent's ``gc.freeze()`` before it forks the template
(:mod:`elastrun.agent.workers.template_fork`), a node's start-up costs 0.36 CPU-s (10 %) less.

A worker's own imports (in the user's script) are left as Python does them.

:func:`torch_loaded_with` remembers the environment torch loaded with when this module loaded it: an
agent whose torch was loaded so, with the variables the template would load it with, may still fork
its template (:func:`elastrun.agent.workers.template_fork.why_not`).  The test suite's warm starter
(``tests/warm.py``) loads torch that way before it forks agents.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType

#: ``os.environ`` as it was when :func:`import_quickly` loaded torch; None until then, or for good where
#: torch was loaded otherwise.
_torch_env: dict[str, str] | None = None


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Keep the cyclic collector off inside the block; put it back as it was (a caller may keep it off).

    ``freeze``: a block that ends normally also freezes every object of the process (``gc.freeze()``)
    before the collector resumes, for a process about to fork children that share those objects' pages
    (the agent before its template, the template before its workers).  Frozen then, and not after: every
    object made in the block waits in the youngest generation, and the collector's first run after the
    pause would walk them all (0.07 s for ``import torch`` on two cores), on the way to the first fork.
    No full collection comes first either: it cost the template 0.1 s and freed about 1,700 of the
    120,000 objects its imports made (docs/benchmarks.md, "The imports frozen before the collector
    resumes"); those stay, frozen, for good.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            gc.freeze()
    finally:
        if was_on:
            gc.enable()


def import_quickly(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with the collector paused while the import runs.

    Cheap once ``name`` is imported (a dictionary lookup), so it stands wherever a first import may happen::

        dist = import_quickly("torch.distributed")
        store = dist.TCPStore(...)
    """
    global _torch_env
    loads_torch = name.partition(".")[0] == "torch" and "torch" not in sys.modules
    environ = dict(os.environ) if loads_torch else None
    with collector_paused():
        module = importlib.import_module(name)
    if loads_torch:
        _torch_env = environ
    return module


def torch_loaded_with() -> Mapping[str, str] | None:
    """The environment torch loaded with, where :func:`import_quickly` loaded it; else None."""
    return _torch_env
