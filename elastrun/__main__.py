"""``python -m elastrun``: the same as the ``elastrun`` command."""

from elastrun.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
