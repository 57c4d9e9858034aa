"""The worker pool: starting, tracking and stopping worker actors on the Ray cluster.

Each worker gets a placement group of its own (one bundle), so the pool can grow and
shrink one worker at a time: a failed worker's bundle is released, a new request waits in
Ray until the cluster has room. ``poll()`` reports which started workers are built and
ready to join. This is the only part of membership that talks to Ray
(``elastic_dp.control.membership.Membership`` drives it, or a fake in tests).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import ray
from ray.autoscaler.sdk import request_resources
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic_dp.config import ClusterConfig, TrainConfig
from elastic_dp.control.membership.kept import KEPT, RESET_TIMEOUT_S, Kept
from elastic_dp.control.placement import resolve_device, worker_bundle
from elastic_dp.errors import PlacementError
from elastic_dp.messages import LeaveNotice, WorkerInfo
from elastic_dp.task import Task
from elastic_dp.worker.actor import remote_worker_class
from elastic_dp.worker.leave import NOTICE_POLL_S, draining_nodes, forget_notices, notice_key, read_notices

logger = logging.getLogger(__name__)

STANDBY_PING_S = 1.0
"""How often a ready worker outside the group (a spare) is asked whether it is alive."""

SETTLE_SETUPS_S = 5.0
"""How long a task error waits for the other workers' builds, which fail alike, before it is raised."""


@dataclass(eq=False)
class Member:
    """One worker actor and its placement group."""

    id: int
    group: PlacementGroup
    actor: object | None = None
    setup_ref: object | None = None
    placed_ref: object | None = None
    info: WorkerInfo | None = None
    stopped: bool = False
    ping_ref: object | None = None
    """A heartbeat in flight while it stands by (``WorkerPool.gone``)."""
    kept: bool = False
    """A process kept from an earlier run (``elastic_dp.keep_workers``)."""

    def __repr__(self) -> str:
        return f"worker-{self.id}"

    @property
    def ready_time(self) -> float:
        """Wall-clock time at which the worker finished building its task."""
        return self.info.ready_time


class WorkerPool:
    """Starts workers in the background and hands out the ones that are ready."""

    def __init__(self, task: Task, train: TrainConfig, cluster: ClusterConfig) -> None:
        self.task, self.train, self.cluster = task, train, cluster
        self._device: str | None = None  # resolved on the first start, when Ray is up
        self._ids = itertools.count()
        self._cls = remote_worker_class()
        self._next_notice_read = 0.0
        self._next_ping = 0.0
        self._written: dict[str, LeaveNotice] = {}  # the notices in the GCS at the last read
        self.pending: list[Member] = []   # placement or setup not finished
        self.all: list[Member] = []

    @property
    def device(self) -> str:
        """``cpu`` or ``cuda``: the cluster config's device, ``auto`` resolved."""
        if self._device is None:
            device = resolve_device(self.cluster.device)
            self.cluster.backend_for(device)  # --backend nccl on CPU workers is refused here
            self._device = device
        return self._device

    @property
    def _kind(self) -> tuple:
        """What a kept worker must match to serve this run: the Ray job, the device, its share."""
        gpu = self.cluster.gpus_per_worker if self.device == "cuda" else 0.0
        return ray.get_runtime_context().get_job_id(), self.device, gpu

    def _worker_settings(self) -> dict:
        return {"backend": self.cluster.backend_for(self.device), "leave_grace_s": self.cluster.leave_grace_s,
                "collective_timeout_s": self.cluster.collective_timeout_s}

    def start(self, count: int) -> None:
        """Request ``count`` more workers; they become ready when placed and built. The
        run's first workers are kept ones of its kind, as many as there are
        (``elastic_dp.keep_workers()``); the kept workers it does not take are stopped then,
        so their slots are free for its other workers and for replacements, which start anew."""
        first = not self.all
        for _ in range(count):
            kept = KEPT.take(self._kind) if first and KEPT.kept else None
            if kept is None:
                member = Member(id=next(self._ids),
                                group=placement_group([worker_bundle(self.device, self.cluster.gpus_per_worker)]))
            else:  # placed and started: its task is built at once
                member = Member(id=next(self._ids), group=kept.group, actor=kept.actor, kept=True)
                member.setup_ref = member.actor.setup.remote(self.task, self.train, self._worker_settings())
            member.placed_ref = member.group.ready()
            self.pending.append(member)
            self.all.append(member)
        if first:
            KEPT.stop_all()

    def poll(self) -> list[Member]:
        """Advance pending workers; return the ones that became ready to join."""
        ready: list[Member] = []
        for member in list(self.pending):
            if member.actor is None:
                if not ray.wait([member.placed_ref], timeout=0)[0]:
                    continue
                gpu = self.cluster.gpus_per_worker if self.device == "cuda" else 0
                member.actor = self._cls.options(
                    num_cpus=1, num_gpus=gpu, max_restarts=0, max_concurrency=3,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=member.group,
                                                                         placement_group_bundle_index=0),
                ).remote(device=self.device, backend=self.cluster.backend_for(self.device), num_threads=1,
                         collective_timeout_s=self.cluster.collective_timeout_s,
                         leave_grace_s=self.cluster.leave_grace_s)
                member.setup_ref = member.actor.setup.remote(self.task, self.train)
            done, _ = ray.wait([member.setup_ref], timeout=0)
            if done:
                self.pending.remove(member)
                try:
                    member.info = ray.get(member.setup_ref)
                except ray.exceptions.RayActorError as exc:
                    logger.warning("%r died while starting: %s", member, exc)
                    self.stop(member)
                    if member.kept:  # it died while kept: one started in its place
                        self.start(1)
                    continue
                except Exception:  # a task error (TaskError): the run ends with it
                    self._settle_setups()
                    raise
                ready.append(member)
        return ready

    def _settle_setups(self) -> None:
        """Take the outcome of every build still under way, up to ``SETTLE_SETUPS_S``: the
        other workers build the same task and fail alike, and an error nobody took would be
        printed by Ray at the end ("Unhandled error ...") beside the run's own one line."""
        refs = [m.setup_ref for m in self.pending if m.setup_ref is not None]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=SETTLE_SETUPS_S) if refs else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except Exception:
                pass  # the same error as the one raised, or a worker that died

    def progress_refs(self) -> list:
        """One object ref per pending worker, done when it has moved on (placed, or built):
        a ``ray.wait`` on them wakes as soon as ``poll`` has news."""
        return [m.placed_ref if m.actor is None else m.setup_ref for m in self.pending]

    def wait_ready(self, count: int, timeout_s: float) -> list[Member]:
        """Block until ``count`` workers are ready or ``timeout_s`` passes; return the ready ones."""
        deadline = time.monotonic() + timeout_s
        ready: list[Member] = []
        while True:
            ready += self.poll()
            if len(ready) >= count or time.monotonic() >= deadline:
                return ready
            time.sleep(0.05)

    def leave_notices(self, members: list[Member]) -> dict[Member, LeaveNotice]:
        """The notices that concern ``members`` now (read at most every ``NOTICE_POLL_S``;
        between reads, none): Ray drains their node, or a notice in the GCS names the
        worker or its node (a SIGTERM, ``elastic-dp release``)."""
        now = time.monotonic()
        if now < self._next_notice_read:
            return {}
        self._next_notice_read = now + NOTICE_POLL_S
        try:
            draining, written = draining_nodes(), read_notices()
            self._written = written
        except Exception as exc:  # an older or unusual cluster: no notices, the failure path remains
            logger.warning("could not read leave notices: %s", exc)
            return {}
        notices, now_s = {}, time.time()
        for m in members:
            node = m.info.node_id if m.info is not None else None
            actor = m.actor._actor_id.hex() if m.actor is not None else None
            if node in draining:
                notices[m] = LeaveNotice("drain", f"drain of node {node[:12]} by Ray", draining[node])
            released = written.get(notice_key("node", node))  # for the workers ready by then
            if released is not None and m.info is not None and m.info.ready_time <= (released.issued or now_s):
                notices[m] = released
            own = written.get(notice_key("actor", actor))  # this very worker's
            if own is not None:
                notices[m] = own
        return notices

    def gone(self, workers: list[Member]) -> list[Member]:
        """Those of ``workers`` (ready, standing by) whose last heartbeat failed: the actor
        died. A heartbeat goes to each at most every ``STANDBY_PING_S``; its answer is read
        at a later call, so a check costs no wait."""
        dead = []
        for m in workers:
            if m.ping_ref is None or not ray.wait([m.ping_ref], timeout=0)[0]:
                continue
            ref, m.ping_ref = m.ping_ref, None
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(m)
        now = time.monotonic()
        if now >= self._next_ping:
            self._next_ping = now + STANDBY_PING_S
            for m in workers:
                if m.ping_ref is None and m not in dead:
                    m.ping_ref = m.actor.heartbeat.remote()
        return dead

    def placed_but_starting(self) -> int:
        return sum(1 for m in self.pending if m.actor is not None)

    def stop(self, member: Member) -> None:
        """Kill the worker and release its bundle (once; a second call does nothing)."""
        if member.stopped:
            return
        member.stopped = True
        if member.actor is not None:
            ray.kill(member.actor, no_restart=True)
            key = notice_key("actor", member.actor._actor_id.hex())
            if key in self._written:  # its own notice is done with (a node's stays: it names a node)
                forget_notices([key])
        remove_placement_group(member.group)
        if member in self.pending:
            self.pending.remove(member)

    def stop_all(self) -> None:
        """Stop every worker; inside ``elastic_dp.keep_workers()`` keep the ready ones that
        reset within ``RESET_TIMEOUT_S`` and whose node is not draining, for the next run."""
        for member in self._keep() if KEPT.active else ():
            member.stopped = True
            KEPT.put(Kept(self._kind, member.actor, member.group))
        ending = [m.actor.end.remote() for m in self.all if not m.stopped and m.actor is not None]
        if ending:  # told first, so that the SIGTERM of their stop is not taken for a leave notice
            ray.wait(ending, num_returns=len(ending), timeout=2.0)
        for member in self.all:
            try:
                self.stop(member)
            except Exception as exc:  # already gone
                logger.debug("stopping %r: %s", member, exc)
        self.all.clear()

    def _keep(self) -> list[Member]:
        """The ready workers that reset for the next run."""
        try:
            draining = draining_nodes()
        except Exception:  # an older or unusual cluster: none drains
            draining = {}
        released = {key for key in self._written}
        ready = [m for m in self.all if not m.stopped and m.info is not None and m not in self.pending
                 and m.info.node_id not in draining and notice_key("node", m.info.node_id) not in released
                 and notice_key("actor", m.actor._actor_id.hex()) not in released]
        resets = {m.actor.reset.remote(): m for m in ready}
        done, _ = ray.wait(list(resets), num_returns=len(resets), timeout=RESET_TIMEOUT_S) if resets else ([], [])
        kept = []
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # it died, or refused (a SIGTERM): stopped with the rest
                logger.info("%r is not kept: %s", resets[ref], exc)
                continue
            kept.append(resets[ref])
        return kept

    def request_capacity(self, count: int) -> None:
        """A standing request to Ray's autoscaler (KubeRay's in-tree one on Kubernetes) for a
        cluster with room for ``count`` workers; 0 withdraws it. Without an autoscaler it
        only records the request."""
        try:
            request_resources(bundles=[worker_bundle(self.device, self.cluster.gpus_per_worker)] * count)
        except Exception as exc:  # an older or unusual cluster: the run goes on without it
            logger.warning("could not ask the autoscaler for %d workers: %s", count, exc)

    def placement_error(self, wanted: int, timeout_s: float, ready: int) -> PlacementError:
        """The error for ``wanted`` workers not placed within ``timeout_s`` (``ready`` are)."""
        starting = self.placed_but_starting()
        bundle = worker_bundle(self.device, self.cluster.gpus_per_worker)
        total = int(min(ray.cluster_resources().get(k, 0) // v for k, v in bundle.items()))
        return PlacementError(
            f"could not place {wanted} workers ({bundle} each) within {timeout_s:.0f} s: {ready + starting} were "
            f"placed ({ready} ready, {starting} still starting) and the cluster has room for {total} in all. "
            "Lower --workers (or MIN in --workers MIN:MAX), free or add capacity, or raise --placement-timeout")
