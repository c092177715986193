"""Code that runs inside each worker process: the bootstrap, the pool's template, the process-group
guard, heartbeats, error files and the worker's end of the control channel.  Imports nothing from the
agent's side (``elastrun.agent``, ``elastrun.agent.workers``); both sides share :mod:`elastrun.shared.protocol`."""
