"""A worker whose end goes wrong on purpose, before or after its script returns.

``TEARDOWN`` (environment) picks the fault:

- ``abort-after``: the script returns; an ``atexit`` handler then aborts (SIGABRT), as torch's
  process-group destructors sometimes do in interpreter teardown;
- ``hang-after``: the script returns; an ``atexit`` handler then never returns;
- ``abort-before``: the script aborts before it returns (a real failure).

Only local rank ``TEARDOWN_RANK`` (default 0) misbehaves.  Every rank first prints ``work done RANK``.

With ``GUARD_PROBE=1`` every rank first forms a gloo group and destroys it, having imported
``destroy_process_group`` by name before ``torch.distributed`` as a module, then prints
``guarded A B C``: whether both names are elastrun's guard and whether the destroyed group is kept
until the exit (:mod:`elastrun.worker.pg_guard`).
"""

import atexit
import os
import time

if os.environ.get("GUARD_PROBE") == "1":
    from torch.distributed import destroy_process_group as imported_early  # noqa: I001 (first, by name)

    import torch.distributed as dist
    from elastrun.worker import pg_guard

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    dist.destroy_process_group()
    print("guarded", getattr(imported_early, "__elastrun_keeps_groups__", False),
          getattr(dist.destroy_process_group, "__elastrun_keeps_groups__", False),
          any(g is group for g in pg_guard.KEPT), flush=True)

fault = os.environ.get("TEARDOWN", "")
mine = os.environ.get("LOCAL_RANK") == os.environ.get("TEARDOWN_RANK", "0")
print(f"work done {os.environ.get('RANK')}", flush=True)
if mine and fault == "abort-before":
    os.abort()
if mine and fault == "abort-after":
    atexit.register(os.abort)
if mine and fault == "hang-after":
    atexit.register(time.sleep, 600)
