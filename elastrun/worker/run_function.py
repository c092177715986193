"""Worker entry point for :func:`elastrun.launcher.launch` with a function.

``python -m elastrun.worker.run_function CALL_FILE RESULT_DIR``: load (module, name, args) from
``CALL_FILE``, call the function, and write its return value to ``RESULT_DIR/result_<rank>.pkl``.
A function defined in the launching script's ``__main__`` is found by running that script as a
module named ``__mp_main__`` (so its ``if __name__ == "__main__"`` block does not run again).
"""

from __future__ import annotations

import importlib
import os
import pickle
import runpy
import sys

from elastrun.worker.errorfile import record


def _resolve(module: str, qualname: str, main_path: str | None):
    if module == "__main__":
        if main_path is None:
            raise RuntimeError("cannot find the launching script of a function defined in __main__")
        namespace = runpy.run_path(main_path, run_name="__mp_main__")
        target = namespace[qualname.split(".")[0]]
        rest = qualname.split(".")[1:]
    else:
        target = importlib.import_module(module)
        rest = qualname.split(".")
    for part in rest:
        target = getattr(target, part)
    return target


@record
def main(argv: list[str]) -> None:
    call_file, result_dir = argv
    with open(call_file, "rb") as fh:
        module, qualname, args, main_path = pickle.load(fh)
    fn = _resolve(module, qualname, main_path)
    value = fn(*args)
    rank = int(os.environ.get("RANK", "0"))
    tmp = os.path.join(result_dir, f".result_{rank}.tmp")
    with open(tmp, "wb") as fh:
        pickle.dump(value, fh)
    os.replace(tmp, os.path.join(result_dir, f"result_{rank}.pkl"))


if __name__ == "__main__":
    main(sys.argv[1:])
