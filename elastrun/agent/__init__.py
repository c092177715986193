"""The node agent (runs in the agent process): its loop in ``agent.py`` and the rooms it uses.

Runs in: the agent.  ``workers/`` is its side of the worker processes; it imports nothing that
runs inside a worker (``elastrun.worker``, ``elastrun.train``) and shares :mod:`elastrun.shared` with them.
"""
