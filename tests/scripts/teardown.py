"""A worker whose end goes wrong on purpose, before or after its script returns.

``TEARDOWN`` (environment) picks the fault:

- ``abort-after``: the script returns; an ``atexit`` handler then aborts (SIGABRT), as torch's
  process-group destructors sometimes do in interpreter teardown;
- ``hang-after``: the script returns; an ``atexit`` handler then never returns;
- ``abort-before``: the script aborts before it returns (a real failure).

Only local rank ``TEARDOWN_RANK`` (default 0) misbehaves.  Every rank first prints ``work done RANK``.
"""

import atexit
import os
import time

fault = os.environ.get("TEARDOWN", "")
mine = os.environ.get("LOCAL_RANK") == os.environ.get("TEARDOWN_RANK", "0")
print(f"work done {os.environ.get('RANK')}", flush=True)
if mine and fault == "abort-before":
    os.abort()
if mine and fault == "abort-after":
    atexit.register(os.abort)
if mine and fault == "hang-after":
    atexit.register(time.sleep, 600)
