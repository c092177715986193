"""Code that runs inside each worker process: the bootstrap, the pool's template, the process-group
guard, heartbeats, error files and the worker's end of the control channel.

Runs in: each worker (the pool's template too).  Imports nothing from the agent's side
(``elastrun.agent``, ``elastrun.rendezvous``); both sides share :mod:`elastrun.shared`.  The training
library, :mod:`elastrun.train`, runs in each worker too.
"""
