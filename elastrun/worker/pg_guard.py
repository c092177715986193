"""Keep destroyed process groups alive until the worker exits: a guard against a torch deadlock.

``dist.destroy_process_group()`` forgets the group, and the C++ backend is destroyed when the
last Python reference goes, typically when the script's DDP model is freed as ``main()``
returns.  ``~ProcessGroupGloo`` then joins gloo's worker threads while the freeing thread holds
the GIL; if a worker thread is at that moment dropping its last finished work item, it needs
the GIL too (the item's thread-local state holds the ``contextvars`` copy that autograd stashes
on every ``backward()``), and the rank hangs for ever with its work done (pytorch#56297's
family).  Measured here with the DDP tutorial's ending (``destroy_process_group()``, then
``main()`` returns): 2 hangs in 12 jobs under the warm pool, 0 in 16 with this guard.

The guard wraps ``destroy_process_group`` so that the groups it destroys stay referenced until
the process ends.  The worker bootstrap leaves with ``os._exit``, so their destructors never run;
a group's threads and sockets live until then, idle.  Everything else ``destroy_process_group``
does (forgetting the group, allowing a new ``init_process_group``) is unchanged.

It is installed in every elastrun worker: by the warm pool's template once ``torch.distributed``
is imported (forked workers inherit it), and by the exec'd bootstrap through an import hook that
applies it the moment the script imports ``torch.distributed``.  ``ELASTRUN_KEEP_DESTROYED_GROUPS=0``
turns it off.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

#: Process groups destroyed by the script, kept referenced until the process exits.
KEPT: list[Any] = []
_MARK = "__elastrun_keeps_groups__"


def enabled() -> bool:
    """Whether the guard applies (``ELASTRUN_KEEP_DESTROYED_GROUPS`` is not ``0``)."""
    return os.environ.get("ELASTRUN_KEEP_DESTROYED_GROUPS", "1") != "0"


def install() -> None:
    """Apply the guard now if ``torch.distributed`` is imported, else when it is."""
    if not enabled():
        return
    module = sys.modules.get("torch.distributed")
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _patch(dist: ModuleType) -> None:
    """Wrap ``destroy_process_group`` in ``torch.distributed`` and its ``distributed_c10d``."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    original = getattr(c10d, "destroy_process_group", None) if c10d is not None else None
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        world = getattr(c10d, "_world", None)
        try:
            KEPT.extend(list(world.pg_map) if group is None and world is not None else [group])
        except Exception:  # an internal layout this guard does not know: destroy as torch does
            pass
        return original(group)

    setattr(destroy_process_group, _MARK, True)
    c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; makes ``torch.distributed``'s loader apply the guard once it has run."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader
        return spec


def release_oldest(keep: int) -> None:
    """Drop the guard's references to all but the ``keep`` most recently destroyed groups.

    For a process that re-forms its group many times (``elastrun.train.run``): a group that has
    been idle for a whole round has no work item left in flight, so freeing it now cannot meet
    the race this guard avoids, and the kept groups (threads, sockets) stay bounded.
    """
    if keep >= 0 and len(KEPT) > keep:
        del KEPT[: len(KEPT) - keep]
