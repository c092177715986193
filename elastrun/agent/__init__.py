"""The node agent (runs in the agent process): its loop in ``agent.py`` and the rooms it uses."""
