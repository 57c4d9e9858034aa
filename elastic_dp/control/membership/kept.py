"""Worker processes kept between runs: ``elastic_dp.keep_workers()``.

A worker's start is a process, torch imported, and the task built: seconds on a CPU, tens
of seconds on a GPU node. A driver that runs several ``Trainer.fit()`` in one Ray session
(a sweep, a notebook, a test suite) can keep the processes of one run for the next::

    with elastic_dp.keep_workers():
        for lr in (1e-3, 3e-3):
            Trainer(task, train=TrainConfig(...), cluster=ClusterConfig(workers=4)).fit()

Inside the block, a run that ends hands each of its healthy workers back here instead of
killing it: the worker first drops everything of the run (``WorkerActor.reset``: its model,
optimizer, program, threads and collective group; the environment variables the run set;
the job's own modules, which the next run imports afresh), and keeps its placement group,
so its slot stays reserved. The next run's first workers are kept ones of its kind (same
Ray job, device and GPU share), as many as there are and it asks for; it builds its task
on them, and stops the kept workers it did not take, so that their slots are free for its
own (its replacements and joiners start anew). A worker the run lost, one that did not
reset within ``RESET_TIMEOUT_S``, and one whose node was asked to drain or that was sent
SIGTERM are stopped as before. When the block ends, every kept worker is stopped.

What carries over from one run to the next in a kept process: the libraries it imported
(torch, transformers, ...) with whatever global settings a task changed in them (say
``torch.set_default_dtype``: set them in the task's factories, not at import), the
process's memory high-water mark, and the Ray worker. Every run builds its model,
optimizer and data from its own task and seed, so its results do not depend on which
process ran it: a kept worker ends a run where a new one does.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Hashable, Iterator

logger = logging.getLogger(__name__)

RESET_TIMEOUT_S = 10.0
"""How long a worker may take to drop its run before it is stopped instead."""


@dataclass(eq=False)
class Kept:
    """A worker actor and its placement group, reset and waiting for a run of its kind."""

    kind: Hashable
    actor: Any
    group: Any


class KeptWorkers:
    """The process's kept workers, while a ``keep_workers()`` block is open (``active``)."""

    def __init__(self) -> None:
        self.depth = 0
        self.kept: list[Kept] = []

    @property
    def active(self) -> bool:
        return self.depth > 0

    def take(self, kind: Hashable) -> Kept | None:
        """A kept worker of ``kind``, if any (the one kept first)."""
        for i, kept in enumerate(self.kept):
            if kept.kind == kind:
                return self.kept.pop(i)
        return None

    def put(self, kept: Kept) -> None:
        self.kept.append(kept)

    def stop_all(self) -> None:
        """End every kept worker's process and release its slot (each told first, so that the
        SIGTERM of its stop is not taken for a leave notice)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        kept, self.kept = self.kept, []
        try:
            ending = [k.actor.end.remote() for k in kept]
            if ending:
                ray.wait(ending, num_returns=len(ending), timeout=2.0)
        except Exception as exc:  # its Ray session ended: nothing is left to stop
            logger.debug("telling the kept workers: %s", exc)
        for k in kept:
            try:
                ray.kill(k.actor, no_restart=True)
                remove_placement_group(k.group)
            except Exception as exc:  # its Ray session ended, or the actor is gone already
                logger.debug("stopping a kept worker: %s", exc)


KEPT = KeptWorkers()
"""This driver process's kept workers."""


@contextlib.contextmanager
def keep_workers() -> Iterator[None]:
    """Keep the worker processes of the runs made inside the block for the next run (see
    the module's docstring); stop them when the outermost block ends."""
    KEPT.depth += 1
    try:
        yield
    finally:
        KEPT.depth -= 1
        if not KEPT.active:
            KEPT.stop_all()
