"""The agent's side of worker processes: starting them (exec, warm pool), their output, what they leave
behind (heartbeats, exit reports, error files) and the agent's end of the control channel.

Runs in: the agent.  Imports nothing that runs inside a worker (``elastrun.worker``,
``elastrun.train``); both sides share :mod:`elastrun.shared`.
"""
