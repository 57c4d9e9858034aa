"""Asynchronous SGD (``--mode async``): parameter-server shards, leases, bounded staleness.

The coordinator is a sequencer, and no tensor passes through it. For a worker that needs
work it leases the next sampler step (``.ledger``), submits a ``params`` call to every
shard, and the worker's ``async_gradient`` call with those calls' results as arguments:
Ray hands the shard's pieces to the worker through its object store, and the pieces are
of one version, because every call to a shard is submitted by this coordinator, in one
order (``.shard``). The worker computes the gradient of the step's whole global batch
and returns it cut into shard pieces, as separate objects. When its small report comes
back, the ledger decides: too stale, the worker pulls again and recomputes the same step;
otherwise the update gets the next version and each shard is sent its ``apply`` with the
worker's piece (an object reference: again straight from the worker to the shard).

Workers join and leave without any re-formation: a joiner is given a lease, and the step
of a worker that dies is leased again. Every applied update is a line of
``updates.jsonl`` (``Update``); a plain loop that recomputes each gradient on its recorded
base version and applies them in version order ends on ``final.safetensors``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray

from ...checkpoint import manifest_of
from ...config import ClusterConfig, TrainConfig
from ...data import check_resumable
from ...errors import ConfigError, TaskError
from ...faults import Fault, FaultPlan
from ...metrics import RunRecorder
from ..base import Failure, MembersLost, Recovery, RecoveryResult, SaveOutcome
from ..watchdog import HangBounds, Watchdog
from .ledger import Ledger, Update
from .shard import ParameterShard, flat_bounds

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""The longest the sequencer waits for a report before it looks at the heartbeats."""


@dataclass(slots=True)
class _Job:
    """A gradient being computed: ``meta`` is the small report, ``pieces`` the gradient."""

    step: int
    base_version: int
    meta: Any
    pieces: list[Any]
    fault: Fault | None


class AsyncMode:
    """Asynchronous SGD over parameter-server shards (``TrainingMode``)."""

    generation = 0  # there is no collective group to re-form

    def __init__(self, train: TrainConfig, cluster: ClusterConfig, recorder: RunRecorder, faults: FaultPlan,
                 task: Any) -> None:
        self.train, self.cluster, self.recorder, self.faults, self.task = train, cluster, recorder, faults, task
        self.members: list[Any] = []
        self.shards: list[Any] = []
        self.bounds: list[int] = []
        self.ledger: Ledger | None = None
        self.jobs: dict[Any, _Job] = {}
        self.sampler_state: dict[str, int] = {}
        self._saved: list[SaveOutcome] = []  # saves committed since settle_saves
        self._last_update = time.perf_counter()
        self.watchdog = Watchdog(HangBounds(heartbeat_timeout_s=cluster.heartbeat_timeout_s,
                                            stall_floor_s=cluster.stall_floor_s, stall_factor=cluster.stall_factor),
                                 typical_step_s=None)
        """Heartbeats to the workers computing: a frozen one is replaced, its step leased again."""

    # -- start and end -------------------------------------------------------------------
    def start(self, members: list[Any], resume: Any | None) -> int:
        self.members = list(members)
        lengths = {m.info.dataset_len for m in members}
        if len(lengths) != 1:
            raise TaskError(f"workers built datasets of different lengths {sorted(lengths)}: the dataset "
                            "factory must build the same dataset on every worker")
        self.sampler_state = {"seed": self.train.seed, "global_batch": self.train.global_batch,
                              "dataset_len": lengths.pop()}
        numel = members[0].info.num_trainable
        if self.train.ps_shards > numel:
            raise ConfigError(f"--ps-shards {self.train.ps_shards} is more than the model's {numel} trainable "
                              "parameters: use at most that many shards")
        self.bounds = flat_bounds(numel, self.train.ps_shards)
        shard = ray.remote(num_cpus=0, max_restarts=0)(ParameterShard)
        self.shards = [shard.remote(self.task, self.train, lo, hi) for lo, hi in zip(self.bounds, self.bounds[1:])]
        ray.get([s.params.remote() for s in self.shards])  # built (a refused optimizer raises here)
        if resume is not None:
            check_resumable(resume.sampler, self.train, dataset_len=self.sampler_state["dataset_len"])
        self._restart(resume)
        self.recorder.event("group_formed", generation=0, world_size=len(members), ps_shards=len(self.shards),
                            mode="async")
        if resume is not None:
            self.recorder.event("resumed", step=resume.step, saved_world_size=resume.world_size,
                                world_size=len(members), checkpoint=resume.url)
        self._write_weights("initial")
        return self.ledger.version

    def _restart(self, checkpoint: Any | None) -> None:
        """Every shard at ``checkpoint``'s step (each reads its own pieces), or at 0."""
        step = 0
        if checkpoint is not None:
            step = ray.get([s.load_checkpoint.remote(checkpoint) for s in self.shards])[0]
        self.jobs = {}
        self.ledger = Ledger(step, max_staleness=self.train.max_staleness, staleness_lr=self.train.staleness_lr,
                             lr_factor=self.train.lr_factor)

    def finish(self) -> None:
        self._write_weights("final")
        counts = self.ledger.staleness
        self.recorder.event("async_summary", updates=self.ledger.version, recomputed=self.ledger.recomputed,
                            staleness={str(k): counts[k] for k in sorted(counts)})
        self.recorder.summary.sample = None

    def _write_weights(self, name: str) -> None:
        if self.recorder.storage is None:
            return
        parts = ray.get([s.model_part.remote() for s in self.shards])
        template = ray.get(self.members[0].actor.model_state.remote())  # shapes, dtypes, buffers
        flat = {k: v.reshape(-1).clone() for k, v in template.items()}
        for part in parts:
            for key, start, values in part:
                flat[key][start:start + values.numel()] = values.to(flat[key].dtype)
        state = {k: flat[k].reshape(v.shape) for k, v in template.items()}
        if self.recorder.remote:
            from ...checkpoint import save_tensors
            save_tensors(self.recorder.storage, f"{name}.safetensors", state)
        else:
            self.recorder.weights(name, state)

    # -- the sequencer ------------------------------------------------------------------
    def advance(self, step: int, limit: int | None = None, keep_going: Callable[[], bool] = lambda: True) -> int:
        """Apply updates until ``limit`` of them are (default: one more), or, once
        ``keep_going()`` says no, until those already leased are. Either way it returns at
        a quiescent point: nothing is out, and the applied updates are exactly steps
        ``0 .. version - 1`` (a lost worker's step is leased again even when no new one is)."""
        limit = step + 1 if limit is None else limit
        ledger = self.ledger
        while True:
            leasing = keep_going()
            for member in self.members:
                if member not in self.jobs and ledger.may_lease(limit, new=leasing):
                    self._lease(member)
            if not self.jobs:
                return ledger.version
            self._collect()

    def _lease(self, member: Any, step: int | None = None) -> None:
        """Give ``member`` a step (its own again after a refused update: ``step``), and start
        its gradient on the current version."""
        ledger = self.ledger
        if step is None:
            step = ledger.lease(member.id)
        rank = self.members.index(member)
        fault = self.faults.take_due(step, rank)
        slow = self.faults.slow.get(rank)
        pulls = [s.params.remote() for s in self.shards]
        refs = member.actor.async_gradient.options(num_returns=1 + len(self.shards)).remote(
            step, self.sampler_state, self.bounds, fault, slow if slow is not None and slow.slows(step) else None,
            *pulls)
        self.jobs[member] = _Job(step, ledger.version, refs[0], list(refs[1:]), fault)

    def _collect(self) -> None:
        """Wait for a report and act on it; raise ``MembersLost`` when a worker died."""
        by_meta = {job.meta: member for member, job in self.jobs.items()}
        ready, _ = ray.wait(list(by_meta), num_returns=1, timeout=min(POLL_S, self.watchdog.due_in()))
        if not ready:
            hung = self.watchdog.check(list(self.jobs))
            if hung:
                for member, _ in hung:
                    self.jobs.pop(member)
                    self.ledger.release(member.id)
                raise MembersLost(self.members, [m for m, _ in hung], hung[0][1], step=self.ledger.version)
            return
        member = by_meta[ready[0]]
        job = self.jobs.pop(member)
        try:
            meta = ray.get(job.meta)
        except ray.exceptions.RayActorError as exc:
            self.ledger.release(member.id)
            raise MembersLost(self.members, [member], f"{member!r} died: {type(exc).__name__}",
                              step=self.ledger.version) from None
        if meta["error"] is not None:
            raise meta["error"]  # the task's own error: not recoverable
        self.faults.put_back([job.fault])  # the worker came back: its fault did not fire
        update = self.ledger.settle(member.id, job.base_version)
        if update is None:  # too stale: the same step again on the current version
            self._lease(member, job.step)
            return
        for shard, piece in zip(self.shards, job.pieces):
            shard.apply.remote(update.version, piece, update.lr_scale, not meta["finite"])
        self._record(update, meta)

    def _record(self, update: Update, meta: dict) -> None:
        now = time.perf_counter()
        self.recorder.append("updates.jsonl", update.record())
        self.recorder.step(step=update.version - 1, loss=meta["loss"] if meta["finite"] else None,
                           samples=self.train.global_batch, step_s=now - self._last_update,
                           world_size=len(self.members), generation=0,
                           timings={"compute_s": round(meta["compute_s"], 6)}, nonfinite=not meta["finite"],
                           lr=None, grad_norm=meta["grad_norm"])
        self._last_update = now

    # -- membership changes ----------------------------------------------------------------
    def resize(self, members: list[Any]) -> None:
        self.members = list(members)  # a joiner is given a lease by the next advance

    def reform(self, members: list[Any], failure: Failure) -> RecoveryResult:
        for lost in failure.lost:
            self.jobs.pop(lost, None)
            self.ledger.release(lost.id)
        self.members = list(members)
        return RecoveryResult(Recovery.COMMITTED, self.ledger.version)

    def restore(self, members: list[Any], checkpoint: Any) -> None:
        self.members = list(members)
        self._restart(checkpoint)

    def save(self, store: Any, step: int) -> None:
        """A checkpoint at a quiescent point (``advance`` returns at one): each shard writes
        its pieces straight to the storage, in the synchronous mode's format, so either mode
        resumes it at any worker count; this driver writes only the manifest."""
        if self.jobs or self.ledger.version != step or self.ledger.again:
            raise RuntimeError(f"an async checkpoint of step {step} needs a quiescent point "
                               f"(version {self.ledger.version}, {len(self.jobs)} out)")
        start = time.perf_counter()
        directory = store.begin(step)
        reports = ray.get([s.write_checkpoint.remote(store.storage, directory, i) for i, s in enumerate(self.shards)])
        manifest = manifest_of(reports, step=step, sampler=self.sampler_state, world_size=len(self.members),
                               settings=getattr(self, "settings", {}))
        checkpoint = store.commit(directory, manifest)
        seconds = time.perf_counter() - start
        self._saved.append(SaveOutcome(step, checkpoint.url, seconds, seconds,
                                       sum(f["bytes"] for f in manifest["files"].values())))

    def settle_saves(self, wait: bool = False) -> list[SaveOutcome]:
        saved, self._saved = self._saved, []
        return saved

