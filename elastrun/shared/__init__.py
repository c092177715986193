"""The only code both sides of a worker's process boundary import: the agent's and each worker's.

Runs in: the agent and each worker (and the ``elastrun`` command, which is the agent's process).
The agent's side (``elastrun.agent``, ``elastrun.rendezvous``) and the worker's side
(``elastrun.worker``, ``elastrun.train``) import nothing of each other; every module that both load
lives here, and imports nothing of elastrun outside this folder (``tools/import_circles.py`` checks
both).

* :mod:`~elastrun.shared.protocol`: how a worker is entered, the ``ELASTRUN_*`` variables, the
  heartbeat file and exit report, the control channel's messages;
* :mod:`~elastrun.shared.log`: elastrun's own console messages (``-q``/``-v``);
* :mod:`~elastrun.shared.steplog`: the step records workers write and the agent (and ``elastrun
  goodput``/``timeline``) read;
* :mod:`~elastrun.shared.stackdump`: Python stacks on a signal, without stopping the process;
* :mod:`~elastrun.shared.prctl`: parent-death signal, child subreaper;
* :mod:`~elastrun.shared.procexit`: ending a process that loaded torch (a worker, the ``elastrun`` command);
* :mod:`~elastrun.shared.imports`: torch imported with the cyclic collector paused (the agent, the template);
* :mod:`~elastrun.shared.priority`: how low a helper thread goes, and raising it again;
* :mod:`~elastrun.shared.snapshot_wire` and :mod:`~elastrun.shared.replicas`: snapshots moved between
  nodes at wire speed (below).

Each agent runs a snapshot server (:mod:`elastrun.agent.snapserver`, a node service: it outlives
the workers) over its node's snapshot directory in memory (``/dev/shm``).  It serves byte ranges of
the snapshot files to the workers of other nodes (restores of joiners, of ranks whose shards were
on a lost node, of DDP joiners), straight from memory with ``sendfile``, and it keeps replicas of
other nodes' committed shards that their agents push to it (:mod:`elastrun.agent.replicator`).
What both sides import of it:

* :mod:`elastrun.shared.snapshot_wire`: framing, the handshake (an HMAC challenge and response in both
  directions with a key derived from the job token; none without a token), the request names;
* :mod:`elastrun.shared.replicas`: the replica files (a copy of the data and meta files plus a
  ``.sum`` file of block CRCs), the push requests a worker leaves for its agent, and their checks.

docs/train.md, "Peer replicas and the snapshot server", has the protocol and the guarantees.
"""
