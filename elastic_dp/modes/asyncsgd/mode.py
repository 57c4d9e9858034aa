"""Asynchronous SGD (``--mode async``): parameter-server shards, leases, bounded staleness.

The coordinator is a sequencer, and no tensor passes through it. For a worker that needs
work it leases the next sampler step (``.ledger``), submits a ``params`` call to every
shard, and the worker's ``gradient`` call (``.program``) with those calls' results as arguments:
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
import statistics
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable

import ray

from elastic_dp.config import ClusterConfig
from elastic_dp.errors import ConfigError
from elastic_dp.faults import Fault
from elastic_dp.modes.asyncsgd.drains import DrainWatch
from elastic_dp.modes.asyncsgd.ledger import Ledger, Update, copy_plan
from elastic_dp.modes.asyncsgd.shard import Keeper, ParameterShard, flat_bounds
from elastic_dp.modes.base import Failure, MembersLost, Recovery, RecoveryResult, SaveOutcome
from elastic_dp.modes.context import ModeContext
from elastic_dp.modes.saving import commit, write_weights
from elastic_dp.modes.start import check_resume, dataset_length, record_resume
from elastic_dp.modes.watchdog import HangBounds, Watchdog
from elastic_dp.schedules import factor_rule

logger = logging.getLogger(__name__)

SPAWN_AHEAD = 2
"""Shard actors started before the model's size is known, while the workers are placed
(the rest once it is). Each imports torch: more at once would slow the workers' own
start on a small machine, and a refused ``--ps-shards`` would have started them all."""
POLL_S = 1.0
"""The longest the sequencer waits for a report before it looks at the heartbeats."""
PACE_WINDOW = 50
"""Gradients whose compute times set the hang bound (the run's and each worker's median)."""


@dataclass(slots=True)
class _Job:
    """A gradient being computed: ``meta`` is the small report, ``pieces`` the gradient."""

    step: int
    base_version: int
    meta: Any
    pieces: list[Any]
    fault: Fault | None


PS_GPU_SHARE = 0.1
"""With ``--ps-device cuda``, the share of a GPU each shard takes (Ray places it where that
much is free: beside workers of ``--gpus-per-worker`` below 1, or on a GPU of its own)."""


def _new_shard(device: str = "cpu") -> Any:
    """A parameter-server shard's actor (no CPU slot: it only applies updates)."""
    return ray.remote(num_cpus=0, num_gpus=PS_GPU_SHARE if device == "cuda" else 0,
                      max_restarts=0)(ParameterShard).remote()


def _new_keeper() -> Any:
    return ray.remote(num_cpus=0, max_restarts=0)(Keeper).remote()


def refuse_group_settings(cluster: ClusterConfig) -> None:
    """Refuse the collective group's settings, naming the flag: this mode has no group (the
    cluster's settings have no job defaults, so a value other than the declared default was given)."""
    for name, flag in (("backend", "--backend"), ("collective_timeout_s", "--collective-timeout")):
        if getattr(cluster, name) != getattr(ClusterConfig(), name):
            raise ConfigError(f"{flag} is a setting of the collective group, and --mode async has none: drop it, "
                              "or use --mode sync")


class AsyncMode:
    """Asynchronous SGD over parameter-server shards (``TrainingMode``)."""

    generation = 0  # there is no collective group to re-form

    def __init__(self, context: ModeContext) -> None:
        refuse_group_settings(context.cluster)
        train, cluster = context.train, context.cluster
        self.train, self.cluster, self.recorder, self.faults = train, cluster, context.recorder, context.faults
        self.task, self.settings = context.task, context.settings
        self.guard = context.guard()
        self.members: list[Any] = []
        self.shards: list[Any] = []
        self.bounds: list[int] = []
        self.ledger: Ledger | None = None
        self.jobs: dict[Any, _Job] = {}
        self.sampler_state: dict[str, int] = {}
        self._saved: list[SaveOutcome] = []  # saves committed since settle_saves
        self._applies: dict[int, list[Any]] = {}  # shard -> its apply calls not yet seen to succeed
        self._lost_shards: set[int] = set()
        self.has_buffers = False
        """The model has buffers: shard 0 keeps them, and a lease pulls them with the parameters."""
        up = ray.is_initialized()
        self.keeper: Any = _new_keeper() if up and train.mode.ps_shards == 1 else None
        """The copies' keeper of a lone shard."""
        self._spawned = [_new_shard(train.mode.ps_device) for _ in range(min(train.mode.ps_shards, SPAWN_AHEAD))] if up else []
        """Shard processes started at once: they import torch while the workers are placed."""
        self._last_update = time.perf_counter()
        self.drains = DrainWatch()
        """Which shards are on a draining node: they move at the next quiescent point."""
        self.watchdog = Watchdog(HangBounds(heartbeat_timeout_s=cluster.heartbeat_timeout_s,
                                            stall_floor_s=cluster.stall_floor_s, stall_factor=cluster.stall_factor),
                                 typical_step_s=None, alone=True)
        """Heartbeats to the workers computing: a frozen one, or one whose training thread
        stopped making progress, is replaced and its step leased again."""
        self._paces: dict[Any, deque[float]] = defaultdict(lambda: deque(maxlen=PACE_WINDOW))
        """Recent gradient compute times, per member and (key None) of the run."""

    # -- start and end -------------------------------------------------------------------
    def start(self, members: list[Any], resume: Any | None) -> int:
        self.members = list(members)
        self.sampler_state = {"seed": self.train.seed, "global_batch": self.train.global_batch,
                              "dataset_len": dataset_length(members)}
        numel, self.has_buffers = members[0].info.num_trainable, bool(members[0].info.buffers)
        if self.train.mode.ps_shards > numel:
            raise ConfigError(f"--ps-shards {self.train.mode.ps_shards} is more than the model's {numel} trainable "
                              "parameters: use at most that many shards")
        self.bounds = flat_bounds(numel, self.train.mode.ps_shards)
        self.shards = self._spawned + [_new_shard(self.train.mode.ps_device) for _ in range(self.train.mode.ps_shards - len(self._spawned))]
        self._spawned = []
        ray.get([s.setup.remote(self.task, self.train, lo, hi)
                 for s, lo, hi in zip(self.shards, self.bounds, self.bounds[1:])])
        self._applies = {i: [] for i in range(len(self.shards))}
        if len(self.shards) == 1 and self.keeper is None:
            self.keeper = _new_keeper()
        check_resume(resume, self.train, self.sampler_state["dataset_len"])
        self._restart(resume)
        self.recorder.event("group_formed", generation=0, world_size=len(members), ps_shards=len(self.shards),
                            mode="async")
        record_resume(self.recorder, resume, len(members))
        self._write_weights("initial")
        return self.ledger.version

    def _restart(self, checkpoint: Any | None) -> None:
        """Every shard at ``checkpoint``'s step (each reads its own pieces), or at 0."""
        self._drain()
        self._replace_lost()
        step = 0
        if checkpoint is not None:
            step = ray.get([s.load_checkpoint.remote(checkpoint) for s in self.shards])[0]
            if self.keeper is not None:
                self.keeper.trim.remote(-1)
        earlier, self.ledger = self.ledger, Ledger(step, max_staleness=self.train.mode.max_staleness,
                                                   staleness_lr=self.train.mode.staleness_lr,
                                                   lr_factor=factor_rule(self.task, self.train))
        if earlier is not None:
            self.ledger.carry(earlier)

    def standby(self, workers: list[Any]) -> None:
        pass  # a ready worker is leased a step as soon as it joins: none waits beside the run

    def state_copies(self) -> dict[Any, int]:
        return {}  # the state is the parameter servers'

    def close(self) -> None:
        for actor in [*self.shards, *self._spawned, *([self.keeper] if self.keeper is not None else [])]:
            ray.kill(actor)
        self.shards, self._spawned, self.keeper = [], [], None

    def finish(self) -> None:
        self._write_weights("final")
        counts = self.ledger.staleness
        self.recorder.event("async_summary", updates=self.ledger.version, recomputed=self.ledger.recomputed,
                            staleness={str(k): counts[k] for k in sorted(counts)})
        self.recorder.summary.sample = None
        self.recorder.summary.staleness = dict(sorted(counts.items()))
        self.recorder.summary.recomputed = self.ledger.recomputed

    def _write_weights(self, name: str) -> None:
        write_weights(self.recorder, name, self._model_state)

    def _model_state(self) -> dict:
        """The model's state dict, assembled here from the shards' pieces."""
        parts = ray.get([s.model_part.remote() for s in self.shards])
        template = ray.get(self.members[0].actor.model_state.remote())  # shapes, dtypes
        template.update(ray.get(self.shards[0].buffer_values.remote()))  # the buffers of this version
        flat = {k: v.reshape(-1).clone() for k, v in template.items()}
        for part in parts:
            for key, start, values in part:
                flat[key][start:start + values.numel()] = values.to(flat[key].dtype)
        return {k: flat[k].reshape(v.shape) for k, v in template.items()}

    # -- the sequencer ------------------------------------------------------------------
    def advance(self, step: int, limit: int | None = None, keep_going: Callable[[], bool] = lambda: True,
                wake: Callable[[], list] = list) -> int:
        """Apply updates until ``limit`` of them are (default: one more), or, once
        ``keep_going()`` says no, until those already leased are. Either way it returns at
        a quiescent point: nothing is out, and the applied updates are exactly steps
        ``0 .. version - 1`` (a lost worker's step is leased again even when no new one is).
        ``keep_going`` is asked again after each report, or once one of ``wake()``'s refs
        is done (a worker starting)."""
        limit = step + 1 if limit is None else limit
        ledger = self.ledger
        while True:
            starting = self.drains.successors(self._holders(), self._successor)  # built while training goes on
            moving = bool(self.drains.started) and not starting  # ready to take over: quiesce and move
            leasing = keep_going() and not moving
            for member in self.members:
                if member not in self.jobs and ledger.may_lease(limit, new=leasing):
                    self._lease(member)
            if not self.jobs:
                self._check_shards(wait_s=10.0)  # every update applied on every shard, or a shard lost
                if moving:
                    self._move()
                return ledger.version
            self._collect([*wake(), *starting] if leasing else [])

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
        buffers = self.shards[0].buffer_values.remote() if self.has_buffers else None  # the same version
        refs = member.actor.call.options(num_returns=1 + len(self.shards)).remote(
            "gradient", step, self.sampler_state, self.bounds, fault, slow if slow is not None and slow.slows(step) else None,
            *pulls, buffers=buffers)
        self.jobs[member] = _Job(step, ledger.version, refs[0], list(refs[1:]), fault)

    def _collect(self, wake: list) -> None:
        """Wait for a report (or one of the refs in ``wake``) and act on it; raise
        ``MembersLost`` when a worker died."""
        by_meta = {job.meta: member for member, job in self.jobs.items()}
        ready, _ = ray.wait(list(by_meta) + wake, num_returns=1, timeout=min(POLL_S, self.watchdog.due_in()))
        ready = [ref for ref in ready if ref in by_meta]
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
        except ray.exceptions.RayError as exc:
            self.ledger.release(member.id)
            self._check_shards()  # its pull from a dead shard failed: the worker may be fine
            if not isinstance(exc, ray.exceptions.RayActorError):
                raise
            raise MembersLost(self.members, [member], f"{member!r} died: {type(exc).__name__}",
                              step=self.ledger.version) from None
        if meta["error"] is not None:
            raise meta["error"]  # the task's own error: not recoverable
        self._pace(member, meta["compute_s"])
        self.faults.put_back([job.fault])  # the worker came back: its fault did not fire
        update = self.ledger.settle(member.id, job.base_version)
        if update is None:  # too stale: the same step again on the current version
            self._lease(member, job.step)
            return
        for i, (shard, piece) in enumerate(zip(self.shards, job.pieces)):
            fault = self.faults.take(update.version - 1, i, ("shard",))
            self._applies[i].append(shard.apply.remote(update.version, piece, update.lr_scale, not meta["finite"],
                                                       fault, meta["buffer_change"] if i == 0 else None))
        self._record(update, meta)
        self.guard.check_update(update.version, job.step, repr(member), meta["finite"], meta["loss_finite"])
        every = self.train.mode.snapshot_every
        if update.version % every == 0:  # every shard at exactly this version: consistent
            copies = [shard.copy_state.remote() for shard in self.shards]
            for i, copied in enumerate(copies):
                self._holder(self._keeper_of(i)).keep.remote(i, copied)
        self._check_shards(wait_s=0.0)

    def _pace(self, member: Any, compute_s: float) -> None:
        """The watchdog's bounds follow the run's median gradient time and each worker's own."""
        for key in (None, member):
            self._paces[key].append(compute_s)
        self.watchdog.typical_step_s = statistics.median(self._paces[None])
        self.watchdog.paces[member] = statistics.median(self._paces[member])

    # -- a lost parameter-server shard -----------------------------------------------------
    def _keeper_of(self, i: int) -> int | str:
        """Who keeps shard ``i``'s copies: the next shard, or the keeper of a lone shard."""
        return (i + 1) % len(self.shards) if len(self.shards) > 1 else "keeper"

    def _holder(self, key: int | str) -> Any:
        return self.keeper if key == "keeper" else self.shards[key]

    def _check_shards(self, wait_s: float = 2.0) -> None:
        """Raise ``MembersLost`` (no worker lost) when a shard died: an ``apply`` of it
        failed, or (``wait_s`` > 0) it does not answer."""
        dead = []
        for i, shard in enumerate(self.shards):
            refs = self._applies[i] if not wait_s else [*self._applies[i], shard.own_versions.remote()]
            if not refs:
                continue
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    dead.append(i)
                    break
            self._applies[i] = [r for r in self._applies[i] if r not in done]
        if dead:
            self._lost_shards.update(dead)
            raise MembersLost(self.members, [], f"parameter-server shard{'s' * (len(dead) > 1)} "
                              f"{', '.join(map(str, dead))} died", step=self.ledger.version)

    def _drain(self) -> None:
        """Let the gradients out come back, and forget them (a worker computes one at a time)."""
        if self.jobs:
            ray.wait([job.meta for job in self.jobs.values()], num_returns=len(self.jobs), timeout=60)
        self.jobs = {}

    def _rebuild_shards(self, failure: Failure) -> RecoveryResult:
        """Every shard back at the newest version of which each one's state is still held
        (its own copy, or the one its keeper holds); the updates after it are undone and their
        steps leased again. None held: ``STATE_LOST``, the checkpoint's turn."""
        lost, shards = sorted(self._lost_shards), len(self.shards)
        alive = set(range(shards)) - set(lost)
        own = dict(zip(sorted(alive), ray.get([self.shards[i].own_versions.remote() for i in sorted(alive)])))
        keepers = sorted({self._keeper_of(i) for i in range(shards)} - set(lost), key=str)
        kept = dict(zip(keepers, ray.get([self._holder(k).held.remote() for k in keepers])))
        plan = copy_plan(shards, alive, own, kept, self._keeper_of)
        if plan is None:
            return RecoveryResult(Recovery.STATE_LOST, reason=(
                f"parameter-server shard {', '.join(map(str, lost))} died before a copy of it was kept "
                f"(--snapshot-every {self.train.mode.snapshot_every})"))
        version, sources = plan
        copies = [self.shards[i].own_copy.remote(version) if kind == "own" else
                 self._holder(src).export.remote(i, version) for i, (kind, src) in enumerate(sources)]
        ray.wait(copies, num_returns=len(copies), timeout=None)  # out of the survivors before anything changes
        self._drain()
        self._replace_lost()
        ray.get([s.restore.remote(copied) for s, copied in zip(self.shards, copies)])  # each forgets later copies
        if self.keeper is not None:
            self.keeper.trim.remote(version)
        for i, copied in enumerate(copies):  # a rebuilt keeper holds its copies again
            self._holder(self._keeper_of(i)).keep.remote(i, copied)
        undone = self.ledger.roll_back(version)
        self.recorder.event("ps_shards_restored", shards=lost, version=version, updates_undone=failure.step - version,
                            steps_leased_again=sorted(undone))
        return RecoveryResult(Recovery.COMMITTED if version == failure.step else Recovery.ROLLED_BACK, version,
                              details={"restored_version": version, "lost_shards": lost})

    # -- a shard on a draining node: handed over at a quiescent point -------------------------
    def _holders(self) -> dict[int | str, Any]:
        """The actors that hold parameter-server state: shards by index, the lone shard's keeper."""
        return {**dict(enumerate(self.shards)), **({"keeper": self.keeper} if self.keeper else {})}

    def _successor(self, key: int | str) -> tuple[Any, Any]:
        """A new actor to take over ``key``'s state, and the ref of its setup."""
        if key == "keeper":
            return (new := _new_keeper()), new.held.remote()
        new = _new_shard(self.train.mode.ps_device)
        return new, new.setup.remote(self.task, self.train, self.bounds[key], self.bounds[key + 1])

    def _move(self) -> None:
        """Each holder on a draining node hands its state to its successor (which Ray placed
        on another node): a shard its parameters and optimizer state at the current version,
        and the copies it keeps for the shard before it; a keeper its copies. Quiescent:
        no update is out, so none is lost or applied twice."""
        version = self.ledger.version
        for key, (new, built) in self.drains.started.items():
            old = self._holder(key)
            ray.get(built)
            restored = [] if key == "keeper" else [new.restore.remote(old.copy_state.remote())]  # at ``version``
            kept = ray.get(old.held.remote())
            ray.get([*restored, *(new.keep.remote(i, old.export.remote(i, v)) for i, vs in kept.items() for v in vs)])
            if key == "keeper":
                self.keeper = new
            else:
                self.shards[key], self._applies[key] = new, []
            ray.kill(old)
            self.recorder.event("ps_shard_moved", shard=key, version=version, cause="its node is draining")
        self.drains.moved()

    def _replace_lost(self) -> None:
        """A new actor for each lost shard (it builds the initial state; restore follows)."""
        for i in sorted(self._lost_shards):
            self.shards[i] = _new_shard(self.train.mode.ps_device)
            self._applies[i] = []
        ray.get([self.shards[i].setup.remote(self.task, self.train, self.bounds[i], self.bounds[i + 1])
                 for i in self._lost_shards])
        self._lost_shards.clear()

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
        if self._lost_shards:
            return self._rebuild_shards(failure)
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
        try:
            reports = ray.get([s.write_checkpoint.remote(store.storage, directory, i)
                               for i, s in enumerate(self.shards)])
        except ray.exceptions.RayActorError:
            self._check_shards()  # raises MembersLost naming the shard; the save never commits
            raise
        url, size = commit(store, directory, reports, step=step, sampler=self.sampler_state,
                           world_size=len(self.members), settings=self.settings)
        seconds = time.perf_counter() - start
        self._saved.append(SaveOutcome(step, url, seconds, seconds, size))

    def settle_saves(self, wait: bool = False) -> list[SaveOutcome]:
        saved, self._saved = self._saved, []
        return saved

