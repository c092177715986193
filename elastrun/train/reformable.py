"""What ``elastrun.train.run`` needs from the state it carries across in-process re-forms.

:class:`~elastrun.train.state.State` is the one implementation today; a state of another shape
(sharded parameters, say) that implements these methods runs under ``run`` too.  This is an
internal interface of elastrun.train, documented so that ``run`` and ``State`` meet only here,
not in each other's private attributes.  The other way round, a state asks ``run``'s module two
things: ``reform.active()`` (whether it runs under ``run`` with an agent to re-form with: only then
is the live commit worth remembering) and ``with reform.section():`` (a commit or restore that a
re-form's interrupt must not cut; it is raised when the section ends).  The sampler's seam is
:meth:`ElasticSampler.before_first_batch <elastrun.train.sampler.ElasticSampler.before_first_batch>`.
"""

from __future__ import annotations

import abc


class Reformable(abc.ABC):
    """A training state that can stay in its process while the process group changes around it.

    What ``run`` does with it at each re-form::

        link.paused(state.live_step())   # tell the agent which commit this process's objects hold
        ...                              # the old group is gone; join the new round's group
        state.rebind()                   # take the new group's rank and world size
        source = state.restore()         # collective: every rank rolls back to the agreed commit
        link.send(Reformed(step=state.step, source=source, ...))
    """

    #: The last committed (or restored) step.
    step: int

    @abc.abstractmethod
    def restore(self) -> str | None:
        """Collective: load the newest commit every rank can reach; its source, or None (fresh start)."""

    @abc.abstractmethod
    def live_step(self) -> int | None:
        """The committed step this process's own objects can roll back to without a copy, or None
        when they are torn (an ``optimizer.step()`` began after that commit)."""

    @abc.abstractmethod
    def rebind(self) -> None:
        """Take the rank and world size of the current default process group (after a re-form)."""
