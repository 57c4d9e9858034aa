"""The worker's own step loop: a window of steps granted by the coordinator, and batches
prepared one step ahead.

The coordinator does not call the worker once per step. It grants a window: the steps
from ``start`` up to ``until``, with the faults of those steps (fault injection), and
extends the grant (``Grants.extend``, from the worker's control thread) while the
reports of committed steps stream back. A worker that reaches the end of its grant
waits for the next one, or ends the window when that grant was ``final``. Every rank
receives the same grants, so every rank stops at the same step boundary: the coordinator
chooses that boundary (for a join, a checkpoint, the last step) simply by not granting
past it. An abort (``Grants.cancel``) ends a window whose worker waits for a grant.

The coordinator can also end a window early, at a boundary no grant foresaw (a worker
became ready to join): it asks every rank to stop (``Grants.extend(..., stop=True)``).
A rank that has heard it says so in the first commit vote it sends after that (read as
the vote leaves with the last bucket, so the step in flight can carry it), which travels
with the gradients (``comm.vote.Ballot``), so every rank learns it from the same tally and
ends the window after the same step, however late the request reached each of them.

``Prefetcher`` collates the next step's slice on a background thread while the current
step computes (into pinned memory when the device is a GPU). A prepared batch is keyed
by (generation, step, rank, world size): after any change of membership the key differs,
the prepared batch is dropped and the slice is collated afresh.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from elastic_dp.faults import Fault
from elastic_dp.messages import WindowPlan
from elastic_dp.threads import set_os_name


class Grants:
    """The steps this worker may run, extended from the control thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._window, self._until, self._final, self._cancelled = -1, 0, True, False
        self._stop = False
        self._leaving = False  # this worker is going (SIGTERM): every window stops after its first step
        self._faults: dict[int, Fault] = {}
        self._sizes: list[tuple[int, tuple[int, ...] | None]] = []  # (from step, slice sizes), in order
        self._early: list[tuple] = []  # grants before their window

    def open(self, plan: WindowPlan) -> None:
        with self._cv:
            self._window, self._until, self._final, self._cancelled = plan.window, plan.until, plan.final, False
            self._stop = False
            self._faults = dict(plan.faults)
            self._sizes = [(plan.start, plan.sizes)]
            early, self._early = self._early, []
            for grant in early:
                self._extend(*grant)

    def extend(self, window: int, until: int, final: bool, faults: dict[int, Fault],
               sizes: tuple[int, tuple[int, ...] | None] | None = None, stop: bool = False) -> None:
        """``sizes``: (first step, slice sizes) from which the slices change (``--balance``):
        a step not granted before, so that every rank changes at the same step. ``stop``:
        end the window after the first step whose vote leaves after the request (``stopping``)."""
        with self._cv:
            self._extend(window, until, final, faults, sizes, stop)
            self._cv.notify_all()

    def _extend(self, window: int, until: int, final: bool, faults: dict[int, Fault],
                sizes: tuple[int, tuple[int, ...] | None] | None, stop: bool) -> None:
        if window > self._window:  # its window has not opened yet (calls may overtake each other)
            self._early.append((window, until, final, faults, sizes, stop))
        elif window == self._window:
            self._stop = self._stop or stop
            if until >= self._until:
                self._until, self._final = until, final
                self._faults.update(faults)
                if sizes is not None:
                    self._sizes.append(sizes)

    def stopping(self) -> bool:
        """The coordinator asked this window to end early, or this worker is leaving: the
        next vote to leave carries it."""
        with self._cv:
            return self._stop or self._leaving

    def leave(self) -> None:
        """This worker was told to go (``worker.leave``): end every window at the next
        step boundary, so that the coordinator can let it go there."""
        with self._cv:
            self._leaving = True

    def sizes(self, step: int) -> tuple[int, ...] | None:
        """The slice sizes of ``step`` (None: equal slices)."""
        with self._cv:
            return next(sizes for start, sizes in reversed(self._sizes) if start <= step)

    def cancel(self) -> None:
        """End the window at the next step boundary (an abort: the group is going)."""
        with self._cv:
            self._cancelled = True
            self._cv.notify_all()

    def wait_for(self, step: int) -> bool:
        """Block until ``step`` is granted (True) or the window ends before it (False)."""
        with self._cv:
            while step >= self._until and not self._final and not self._cancelled:
                self._cv.wait()
            return step < self._until and not self._cancelled

    def granted(self, step: int) -> bool:
        """``step`` is granted already (its batch is worth preparing)."""
        with self._cv:
            return step < self._until and not self._cancelled

    def fault(self, step: int) -> Fault | None:
        with self._cv:
            return self._faults.pop(step, None)


class Prefetcher:
    """Collates one step's micro-batches ahead, on a background thread."""

    def __init__(self, collate: Callable[[np.ndarray], list[Any]]) -> None:
        self._collate = collate
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[tuple, Future] | None = None
        self.dropped = 0
        """Prepared batches thrown away because the step or the membership changed."""

    def submit(self, key: tuple, indices: np.ndarray) -> None:
        """Start preparing ``indices`` for ``key`` (dropping what was prepared before)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-dp-prefetch",
                                            initializer=set_os_name, initargs=("edp-prefetch",))
        self._drop()
        self._pending = (key, self._pool.submit(self._collate, indices))

    def take(self, key: tuple, indices: np.ndarray) -> list[Any]:
        """The micro-batches of ``key``: prepared ahead if they were, else collated now."""
        if self._pending is not None and self._pending[0] == key:
            _, future = self._pending
            self._pending = None
            return future.result()  # a collate error is raised here, in the step, as before
        self._drop()
        return self._collate(indices)

    def _drop(self) -> None:
        if self._pending is not None:
            self._pending[1].cancel()
            self.dropped += 1
            self._pending = None
