"""Work handles: what a started collective of ``elastic_dp.comm.group`` returns. Each has
``wait(timeout=None)``; the ones here complete a call the process group only started: a
single rank's (nothing to do), gloo's calls on host copies of CUDA tensors (copied back),
gloo's reduce-scatter as an all-to-all (the rows received summed in rank order), a
collective on a slow link (``--inject slowlink``: done no earlier than its delay), and any
gloo collective whose wait must end once its group is aborted (``Abortable``, through
``Watched``)."""

from __future__ import annotations

import datetime
import functools
import time
from typing import Any, Callable

import torch

from elastic_dp.errors import CollectiveError

ABORT_POLL_S = 0.1
"""How often a wait on a gloo collective looks whether its group was aborted."""


class Done:
    """A completed work handle, for the single-rank group."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True


class Staged:
    """A gloo call on host copies of CUDA tensors: ``wait()`` copies the results back.
    ``keep``: a tensor the call reads, held until it is done."""

    def __init__(self, work, results: list[tuple[torch.Tensor, torch.Tensor]],
                 keep: torch.Tensor | None = None) -> None:
        self.work, self.results, self.keep = work, results, keep  # results: (device tensor, its host copy)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        wait_for(self.work, timeout)
        for device, host in self.results:
            device.copy_(host)
        self.keep = None
        return True


class Summed:
    """gloo's reduce-scatter as an all-to-all: once every rank's chunk for this rank has
    arrived (``rows``, one per rank in rank order; this rank's own may be its chunk of the
    input, which was not sent), ``wait()`` sums them into ``output``."""

    def __init__(self, work, rows: list[torch.Tensor], output: torch.Tensor) -> None:
        self.work, self.rows, self.output = work, rows, output

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        wait_for(self.work, timeout)
        if self.rows is not None:  # a second wait() has nothing left to do
            rows, output = self.rows, self.output
            total = output if output.device == rows[0].device else torch.empty(output.shape, dtype=rows[0].dtype)
            torch.add(rows[0], rows[1], out=total.view(-1))  # a world of 1 makes no work
            for row in rows[2:]:
                total.view(-1).add_(row)
            if total is not output:
                output.copy_(total)
            self.rows = None
        return True


class Abortable:
    """A gloo collective whose ``wait()`` also ends, raising ``CollectiveError``, once its
    group is aborted (``aborted()``), whether or not gloo ended the collective.

    An abort shuts the group's sockets down, which makes a collective blocked on them raise
    within milliseconds; but one started on another thread in the moment of the shutdown
    can miss it inside gloo's transport and wait until the collective timeout (measured:
    an aborting rank that issued collectives on a second thread in a loop had one of them
    wait the whole timeout in 2 to 6 of 30 aborts, over 7 runs). So the wait runs in slices of
    ``ABORT_POLL_S`` (a wait with a timeout costs no more than one without: 1.60 against
    1.61 ms a small all-reduce here) and looks between them."""

    def __init__(self, work, aborted: Callable[[], bool], what: str) -> None:
        self.work, self.aborted, self.what = work, aborted, what

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while True:
            left = ABORT_POLL_S if deadline is None else min(ABORT_POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                return self.work.wait(datetime.timedelta(seconds=left))
            except RuntimeError:  # the collective failed, or this slice of the wait ended
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            if self.work.is_completed():  # failed, or done since the slice ended: its own outcome
                return self.work.wait()
            if self.aborted():
                raise CollectiveError(f"{self.what}: the group was aborted while this collective was in flight, "
                                      "which the abort had not ended")


class Watched:
    """A gloo process group whose collectives return ``Abortable`` handles (``aborted``:
    whether the generation was aborted; ``what``: which group, for the error)."""

    COLLECTIVES = frozenset({"allreduce", "alltoall_base", "send", "recv", "broadcast"})

    def __init__(self, pg, aborted: Callable[[], bool], what: str) -> None:
        self.pg, self.aborted, self.what = pg, aborted, what

    def __getattr__(self, name: str) -> Any:
        if name not in self.COLLECTIVES:
            raise AttributeError(f"{name} is not one of the collectives a watched group starts: "
                                 f"{sorted(self.COLLECTIVES)}")
        call = getattr(self.pg, name)

        def started(*args: Any, **kwargs: Any) -> Abortable:
            return Abortable(call(*args, **kwargs), self.aborted, self.what)

        return started


def wait_for(work, timeout: datetime.timedelta | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


class Delayed:
    """A collective on a slow link (``--inject slowlink``): done no earlier than ``until``."""

    def __init__(self, work, until: float) -> None:
        self.work, self.until = work, until

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        time.sleep(max(0.0, self.until - time.monotonic()))
        return done


def delayed_by_link(method):
    """The collective ``method``, its handle delayed by the group's ``delay_s``."""
    @functools.wraps(method)
    def delayed(self, *args):
        work = method(self, *args)
        return Delayed(work, time.monotonic() + self.delay_s) if self.delay_s else work
    return delayed
