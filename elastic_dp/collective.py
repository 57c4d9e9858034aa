"""The collective group: one torch.distributed process group per generation.

A ``CollectiveGroup`` is an object with a lifecycle, never a global::

    group = CollectiveGroup(backend="gloo", timeout_s=300)
    group.configure(store_host, store_port, generation=g, rank=r, world_size=n)
    work = group.all_reduce_async(tensor)   # SUM; ReduceOp.AVG is unreliable on gloo
    ...
    group.destroy()

The rendezvous keys of generation ``g`` live under the prefix ``gen{g}/`` of the
coordinator's TCPStore (DESIGN invariant 1): a straggler from ``g-1`` can never join
``g``, and re-forming on the same store needs that fresh prefix anyway. The process group
is built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), not through
``init_process_group``, so no default group or environment variable is involved and a
new generation is just a new object.

With one rank there is nothing to communicate: the same calls complete at once, so the
single-worker case runs the same code as any other.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class _Done:
    """A completed work handle, for the single-rank group."""

    def wait(self) -> bool:
        return True


class CollectiveGroup:
    """A process group for one generation, with configure / abort / destroy."""

    def __init__(self, *, backend: str, timeout_s: float) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.generation = -1
        self.rank = 0
        self.world_size = 0
        self._store: dist.Store | None = None
        self._pg: dist.ProcessGroup | None = None

    @property
    def configured(self) -> bool:
        return self.world_size > 0

    def configure(self, store_host: str, store_port: int, *, generation: int, rank: int,
                  world_size: int) -> None:
        """Join generation ``generation`` as ``rank`` of ``world_size`` (blocks until all join)."""
        if self.configured:
            self.destroy()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.generation, self.rank, self.world_size = generation, rank, world_size
        if world_size == 1:
            return
        store = dist.TCPStore(store_host, store_port, is_master=False, timeout=self.timeout)
        self._store = dist.PrefixStore(f"gen{generation}/", store)
        if self.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, self.timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._pg = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
        logger.debug("gen %d rank %d/%d: %s group formed", generation, rank, world_size, self.backend)

    def _require(self) -> dist.ProcessGroup | None:
        if not self.configured:
            raise RuntimeError("the collective group is not configured")
        return self._pg

    def all_reduce_async(self, tensor: torch.Tensor):
        """Start a SUM all-reduce of ``tensor`` in place; returns a handle with ``wait()``."""
        pg = self._require()
        if pg is None:
            return _Done()
        return pg.allreduce([tensor])

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.all_reduce_async(tensor).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s copy."""
        pg = self._require()
        if pg is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            pg.broadcast([tensor], opts).wait()
        return tensor

    def abort(self) -> None:
        """Abort the group so that no rank stays blocked in it, then forget it.

        NCCL has a real abort. gloo has none that releases a blocked rank (DESIGN,
        pitfalls); releasing a blocked gloo rank is the elastic layer's job.
        """
        if self._pg is not None and self.backend == "nccl":
            self._pg.abort()
        self._forget()

    def destroy(self) -> None:
        """Release the group after its last collective completed."""
        if self._pg is not None:
            try:
                self._pg.shutdown()
            except (AttributeError, RuntimeError) as exc:  # not every backend implements it
                logger.debug("process group shutdown: %s", exc)
        self._forget()

    def _forget(self) -> None:
        self._pg = None
        self._store = None
        self.world_size = 0
