"""Snapshots moved between nodes at wire speed: the agent's snapshot server and what both sides share.

Each agent runs a snapshot server (:mod:`elastrun.agent.snapserver`, a node service: it outlives
the workers) over its node's snapshot directory in memory (``/dev/shm``).  It serves byte ranges of
the snapshot files to the workers of other nodes (restores of joiners, of ranks whose shards were
on a lost node, of DDP joiners), straight from memory with ``sendfile``, and it keeps replicas of
other nodes' committed shards that their agents push to it (:mod:`elastrun.agent.replicator`).

What both sides import, neither the agent's nor the worker's code:

* :mod:`elastrun.shared.snapshot_wire`: framing, the handshake (an HMAC challenge and response in both
  directions with a key derived from the job token; none without a token), the request names;
* :mod:`elastrun.shared.replicas`: the replica files (a copy of the data and meta files plus a
  ``.sum`` file of block CRCs), the push requests a worker leaves for its agent, and their checks.

docs/train.md, "Peer replicas and the snapshot server", has the protocol and the guarantees.
"""
