"""``python -m elastrun``: the same as the ``elastrun`` command."""

from elastrun.cli import command

if __name__ == "__main__":
    command()
