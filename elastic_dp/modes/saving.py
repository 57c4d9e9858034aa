"""Durable checkpoints written by every member straight to storage, in the background.

A save has two halves. ``stage`` runs on each member's training thread between two
steps and copies that rank's share of the state into host memory: the only time a save
holds training up. ``upload`` runs on each member's I/O thread (the actor's ``io``
concurrency group) while the next steps train: it serialises the share, hashes it and
writes it to the storage. When every upload has come back, the coordinator's side writes
the manifest, which commits the checkpoint (``CheckpointStore.commit``). At most one save
is in flight: a save that comes due while the last is still uploading waits for it.

A member lost while staging is a failure like any other (``MembersLost``). A member lost
while uploading abandons that save: it never gets a manifest, so it does not exist, and
the checkpoint before it stays the latest. A storage that fails a write is the run's
error (``StorageError``): training on without checkpoints is not what was asked for.
With ``asynchronous=False`` both halves run in one call on the training thread and the
save is committed before the next step.

The run's weights files (``write_weights``: ``initial`` and ``final``) are written here too,
by whichever side of the mode can.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ray

from elastic_dp.durable.checkpoint import CheckpointStore, manifest_of
from elastic_dp.durable.weights import TensorSpecs
from elastic_dp.faults import Fault
from elastic_dp.modes.base import SaveOutcome
from elastic_dp.modes.calls import Calls
from elastic_dp.observe.metrics import RunRecorder

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    step: int
    directory: str
    world_size: int
    sampler: dict[str, int]
    refs: dict[Any, Any]
    """upload ref -> member."""
    started: float
    stall_s: float
    bytes: int


class Saves:
    """Starts saves over a group's members and commits them when their parts are written."""

    def __init__(self, store: CheckpointStore, calls: Calls, *, asynchronous: bool = True,
                 settings: dict[str, Any] | None = None) -> None:
        self.store, self.calls, self.asynchronous = store, calls, asynchronous
        self.settings = settings or {}
        self.in_flight: _InFlight | None = None
        self.ended: list[SaveOutcome] = []

    def start(self, members: list[Any], generation: int, step: int, sampler: dict[str, int],
              faults: dict[int, Fault]) -> None:
        """Save the state after ``step`` committed steps, held by ``members`` (rank order).
        Raises ``MembersLost`` when a member is lost before its part is in host memory."""
        if self.in_flight is not None:
            self._settle(wait=True)  # at most one save in flight
        start = time.perf_counter()
        directory = self.store.begin(step)
        storage = self.store.storage
        if not self.asynchronous:
            calls = {m.actor.write_checkpoint.remote(storage, directory, step, sampler, faults.get(rank)): m
                     for rank, m in enumerate(members)}
            reports = self.calls.run(members, calls, generation)
            stall = time.perf_counter() - start
            self._commit(_InFlight(step, directory, len(members), sampler, {}, start, stall, 0),
                         list(reports.values()))
            return
        calls = {m.actor.stage_checkpoint.remote(directory, step, sampler, faults.get(rank)): m
                 for rank, m in enumerate(members)}
        sizes = self.calls.run(members, calls, generation)
        uploads = {m.actor.upload_checkpoint.remote(storage, directory): m for m in members}
        self.in_flight = _InFlight(step, directory, len(members), sampler, uploads, start,
                                   time.perf_counter() - start, sum(sizes.values()))

    def poll(self, wait: bool = False) -> list[SaveOutcome]:
        """Commit the save in flight if its uploads are done (``wait``: wait for them, up
        to the step deadline); return the saves that ended since the last poll."""
        self._settle(wait)
        ended, self.ended = self.ended, []
        return ended

    def _settle(self, wait: bool) -> None:
        save = self.in_flight
        if save is not None:
            refs = list(save.refs)
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.calls.deadline_s if wait else 0)
            if len(done) == len(refs):
                self.in_flight = None
                self._finish(save)
            elif wait:
                self.in_flight = None
                self._abandon(save, f"its upload did not finish within {self.calls.deadline_s:.0f} s "
                                    "(--step-timeout)")

    def _finish(self, save: _InFlight) -> None:
        reports = []
        for ref, member in save.refs.items():
            try:
                reports.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                return self._abandon(save, f"{member!r} was lost while writing its part")
            except ray.exceptions.RayTaskError as exc:
                raise exc.as_instanceof_cause() from None  # the storage failed: the run's error
        self._commit(save, reports)

    def _commit(self, save: _InFlight, reports: list[dict]) -> None:
        url, size = commit(self.store, save.directory, reports, step=save.step, sampler=save.sampler,
                           world_size=save.world_size, settings=self.settings)
        self.ended.append(SaveOutcome(save.step, url, round(save.stall_s, 4),
                                      round(time.perf_counter() - save.started, 4), size))

    def _abandon(self, save: _InFlight, why: str) -> None:
        logger.warning("checkpoint of step %d abandoned: %s", save.step, why)
        self.ended.append(SaveOutcome(save.step, None, round(save.stall_s, 4),
                                      round(time.perf_counter() - save.started, 4), 0, error=why))


def commit(store: CheckpointStore, directory: str, reports: list[dict], *, step: int, sampler: dict[str, int],
           world_size: int, settings: dict) -> tuple[str, int]:
    """Commit a checkpoint whose parts are written: its manifest, from the writers'
    ``reports``, is written last (every mode's saves end here). Returns its URL and bytes."""
    manifest = manifest_of(reports, step=step, sampler=sampler, world_size=world_size, settings=settings)
    checkpoint = store.commit(directory, manifest)
    return checkpoint.url, sum(f["bytes"] for f in manifest["files"].values())


def write_weights(recorder: RunRecorder, name: str, state: Callable[[], dict[str, Any]],
                  on_worker: Callable[[Any, str], None] | None = None,
                  parts: Callable[[], tuple[TensorSpecs, Iterable[dict[str, Any]]]] | None = None) -> None:
    """``<out>/<name>.safetensors`` (nothing without ``--out``): to an ``--out`` URI by a
    worker straight from its memory where the mode has one that can (``on_worker(storage,
    file name)``), else by this driver from ``state()``, or from ``parts()`` (the file's
    ``TensorSpecs``, then its tensors a part at a time) where the mode gives them."""
    if recorder.storage is None:
        return
    if recorder.remote and on_worker is not None:
        on_worker(recorder.storage, f"{name}.safetensors")
    elif parts is not None:
        recorder.weight_parts(name, *parts())
    else:
        recorder.weights(name, state())
