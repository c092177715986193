"""ElasticSampler: a batch sampler whose position is one global counter that survives resizes.

The sample order of an epoch is a permutation seeded by ``(seed, epoch)`` only, so it is the same
whatever the world size.  A step consumes the next *global batch* (``batch_size × world_size``
indices from the current position), and each rank gets its own contiguous slice of it.  Only
:meth:`ElasticSampler.advance` (called by ``State.commit()``) moves the position, so batches
that a DataLoader fetched ahead (``num_workers > 0`` prefetching) or that a crashed step never
committed are served again after a restore.  That is what makes "every sample of an epoch is used
exactly once by committed steps" hold across restarts and world-size changes.

End of an epoch (``drop_last=False``): when fewer than ``global batch + world_size`` samples remain,
the last step takes all of them, split as evenly as possible (slices differ by at most one sample),
so no sample is skipped and no rank gets an empty batch.  The one exception: if a resize leaves
fewer samples than ranks, the ranks without a sample repeat one of the tail (``padded`` tells).
With ``drop_last=True`` the tail smaller than a global batch is skipped instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sized
from typing import Any


def _world() -> tuple[int, int]:
    """``(world_size, rank)`` from the process group, else from the launcher's environment."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
    except ImportError:  # pragma: no cover - torch always has torch.distributed on Linux
        pass
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


class ElasticSampler:
    """Batch sampler for ``DataLoader(dataset, batch_sampler=sampler)``; yields this rank's indices.

    ``dataset`` may be a sized dataset or the number of samples.  ``batch_size`` is per rank.
    ``num_replicas``/``rank`` override the world (default: the process group, else ``WORLD_SIZE``
    and ``RANK``), which is read each time an iterator is created.
    """

    def __init__(
        self,
        dataset: Sized | int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        if n <= 0:
            raise ValueError(f"ElasticSampler needs a non-empty dataset, got {n} samples")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if num_replicas is not None and num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        if rank is not None and num_replicas is not None and not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.num_samples = n
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        #: Current epoch and the number of its samples consumed by committed steps.
        self.epoch = 0
        self.position = 0
        self._order_cache: tuple[int, list[int]] | None = None
        #: Called once, just before the first batch of the next iterator is handed out (State uses
        #: it to apply restored RNG states after the DataLoader has drawn its base seed).
        self._before_first_batch: Callable[[], None] | None = None

    def before_first_batch(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` once, just before the next iterator hands out its first batch.

        ``State.restore()`` applies the restored RNG states there mid-epoch: a DataLoader draws its
        base seed from torch's generator when it creates an iterator, which is after the restore.
        """
        self._before_first_batch = hook

    # -- arithmetic -------------------------------------------------------------------------
    def world(self) -> tuple[int, int]:
        """``(world_size, rank)`` used for the next iterator."""
        ws, rk = _world()
        ws = self.num_replicas if self.num_replicas is not None else ws
        rk = self.rank if self.rank is not None else rk
        if not 0 <= rk < ws:
            raise ValueError(f"rank {rk} is outside the world of size {ws}")
        return ws, rk

    def order(self, epoch: int) -> list[int]:
        """The global sample order of ``epoch`` (independent of the world size)."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            import torch

            g = torch.Generator()
            g.manual_seed((self.seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        self._order_cache = (epoch, order)
        return order

    def global_batch_size(self, position: int, world_size: int) -> int:
        """How many samples the global step starting at ``position`` takes (0: epoch is over)."""
        remaining = self.num_samples - position
        full = self.batch_size * world_size
        if remaining <= 0:
            return 0
        if self.drop_last:
            return full if remaining >= full else 0
        return remaining if remaining < full + world_size else full

    @staticmethod
    def share(total: int, world_size: int, rank: int) -> tuple[int, int]:
        """``(start, length)`` of ``rank``'s slice of a global batch of ``total`` samples."""
        base, extra = divmod(total, world_size)
        return rank * base + min(rank, extra), base + (1 if rank < extra else 0)

    def rank_batch(self, epoch: int, position: int, world_size: int, rank: int) -> list[int]:
        """The indices ``rank`` gets for the global step starting at ``position`` of ``epoch``."""
        total = self.global_batch_size(position, world_size)
        if total == 0:
            return []
        tail = self.order(epoch)[position : position + total]
        start, length = self.share(total, world_size, rank)
        if length == 0:  # fewer samples left than ranks (only after a resize): pad
            return [tail[rank % total]]
        return tail[start : start + length]

    def padded(self, world_size: int | None = None) -> bool:
        """True when the next global batch has fewer samples than ranks (some repeat a sample)."""
        ws = world_size if world_size is not None else self.world()[0]
        return 0 < self.global_batch_size(self.position, ws) < ws

    # -- position -----------------------------------------------------------------------------
    def advance(self) -> None:
        """Mark one global batch as consumed (called by ``State.commit()``); rolls the epoch over."""
        ws, _ = self.world()
        taken = self.global_batch_size(self.position, ws)
        if taken == 0:
            raise RuntimeError(
                f"ElasticSampler.advance(): epoch {self.epoch} is already complete at position "
                f"{self.position}; commit() was called more often than batches were served"
            )
        self.position += taken
        if self.global_batch_size(self.position, ws) == 0:
            self.epoch += 1
            self.position = 0

    def __len__(self) -> int:
        """Batches left in the current epoch from the committed position, at the current world size."""
        ws, _ = self.world()
        count, pos = 0, self.position
        while (taken := self.global_batch_size(pos, ws)) > 0:
            count += 1
            pos += taken
        return count

    def __iter__(self) -> Iterator[list[int]]:
        ws, rk = self.world()
        if self.global_batch_size(0, ws) == 0:
            raise ValueError(
                f"dataset of {self.num_samples} samples has no full global batch of "
                f"{self.batch_size}×{ws}; lower batch_size or use drop_last=False"
            )
        return _EpochIterator(self, self.epoch, self.position, ws, rk)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"ElasticSampler state was saved with {key}={state[key]!r}, this sampler has "
                    f"{key}={getattr(self, key)!r}; the sample order would not match"
                )
        if not 0 <= state["position"] <= self.num_samples:
            raise ValueError(f"ElasticSampler position {state['position']} outside the dataset")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class _EpochIterator:
    """Serves one rank's batches from a fixed start to the end of one epoch; never moves the
    sampler's committed position (prefetched batches are not consumed until committed)."""

    def __init__(self, sampler: ElasticSampler, epoch: int, position: int, world_size: int, rank: int):
        self._s = sampler
        self._epoch = epoch
        self._pos = position
        self._ws = world_size
        self._rank = rank
        self._first = True

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> list[int]:
        taken = self._s.global_batch_size(self._pos, self._ws)
        if taken == 0:
            raise StopIteration
        batch = self._s.rank_batch(self._epoch, self._pos, self._ws, self._rank)
        self._pos += taken
        if self._first:
            self._first = False
            hook, self._s._before_first_batch = self._s._before_first_batch, None
            if hook is not None:
                hook()
        return batch
