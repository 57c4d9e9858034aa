"""The coordinator: the control plane of a run.

An explicit state machine::

    INITIALIZING -> PLACING -> FORMING -> RESTORING -> RUNNING -> FINISHED
                                          RUNNING <-> RECOVERING   (a member failed)
                                          RUNNING <-> RESIZING     (workers join)
                                                (any) -> FAILED

It starts the workers, hosts the rendezvous store, forms each generation's collective
group under its own prefix (DESIGN invariant 1), and drives the steps: for step ``s`` it
takes the sampler's global batch, splits it into contiguous slices over the current
ranks, and commits the step when every member reports it committed (invariants 2, 5).
When members fail it asks the ``ElasticPolicy`` what to do, re-forms the next
generation in place from the survivors (and ready joiners), makes their state equal,
and re-runs the interrupted step on the same samples (invariant 4). With ZeRO the state
is in chunks: ``shard_sources`` picks where each old chunk comes from (a survivor, or a
neighbour's peer snapshot), the new ranks re-cut them for the new world size, and the
run rolls back to the snapshot's step when it is older than the failed step. The
coordinator never touches a tensor: state moves between workers, checkpoints and the
output as opaque objects.
"""

from __future__ import annotations

import enum
import logging
import time

import ray
import torch.distributed as dist

from .checkpoint import CheckpointStore, TrainingState, merge_shards
from .config import CheckpointConfig, ClusterConfig, TrainConfig, check_batch_fits
from .data import ElasticSampler, split
from .dispatch import StepOutcome, gather
from .errors import CheckpointError, ConfigError, MembershipError, TaskError
from .faults import Fault, FaultPlan
from .messages import StepResult
from .metrics import RunRecorder, RunSummary
from .placement import resolve_device
from .policy import Action, ElasticPolicy, MembershipDecision, ShardPlan, shard_sources
from .pool import Member, WorkerPool, placement_error
from .task import Task

logger = logging.getLogger(__name__)


class RunState(enum.Enum):
    INITIALIZING = "initializing"
    PLACING = "placing"
    FORMING = "forming"
    RESTORING = "restoring"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    FINISHED = "finished"
    FAILED = "failed"


class Coordinator:
    """Drives one run from placement to the last committed step, through failures and joins."""

    def __init__(self, task: Task, train: TrainConfig, cluster: ClusterConfig,
                 checkpoint: CheckpointConfig, recorder: RunRecorder, faults: list[Fault] = ()) -> None:
        check_batch_fits(train, cluster)
        joins = sum(1 for f in faults if f.kind == "join")
        if any(f.phase == "checkpoint" and f.rank != 0 for f in faults):
            raise ConfigError("--inject ...:phase=checkpoint applies to rank 0, the rank whose state is saved")
        for f in faults:
            if f.phase == "snapshot" and (not train.zero or (f.step + 1) % train.snapshot_every):
                raise ConfigError(f"--inject ...:step={f.step}:phase=snapshot needs --zero 1 or 2 and a step "
                                  f"after which a snapshot is taken: (step + 1) divisible by --snapshot-every "
                                  f"{train.snapshot_every}")
        self.task, self.train, self.cluster, self.ckpt_cfg = task, train, cluster, checkpoint
        self.recorder = recorder
        self.faults = FaultPlan(list(faults))
        # join:step=S faults hold a worker back at the start and add it at step S
        self.target = max(cluster.min_workers, cluster.workers - joins)
        self.state = RunState.INITIALIZING
        self.generation = -1
        self.members: list[Member] = []
        self.joiners: list[Member] = []
        self.ckpt = CheckpointStore(checkpoint.dir, keep=checkpoint.keep) if checkpoint.dir else None
        self.sampler: ElasticSampler | None = None
        self.pool: WorkerPool | None = None
        self.store: dist.TCPStore | None = None
        self.step = 0

    @property
    def policy(self) -> ElasticPolicy:
        return ElasticPolicy(min_workers=self.cluster.min_workers, max_workers=self.target,
                             wait_timeout_s=self.cluster.min_wait_timeout_s)

    def _to(self, state: RunState) -> None:
        logger.debug("coordinator: %s -> %s", self.state.value, state.value)
        self.state = state

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Place, form, restore, train every remaining step, and tear down."""
        try:
            self.start()
            while True:
                self.run_steps(self.train.steps - self.step)
                if self._finish():
                    break  # else a failure during the final save rolled the run back
            self._to(RunState.FINISHED)
            return self.recorder.finish()
        except BaseException:
            self._to(RunState.FAILED)
            raise
        finally:
            self.close()

    def start(self) -> None:
        """Start the workers, form generation 0 and restore state (checkpoint or rank 0)."""
        self._prepare()
        self._to(RunState.RUNNING)
        self.recorder.start(self.step)

    def close(self) -> None:
        """Stop every worker and release its placement group."""
        # Killing the actors releases their process groups with them; a graceful destroy
        # could block behind a collective that a failed step left running.
        if self.pool is not None:
            self.pool.stop_all()
        self.members, self.joiners, self.store = [], [], None

    def _prepare(self) -> None:
        resume: TrainingState | None = None
        if self.ckpt is not None:
            self.ckpt.check_writable()
            if self.ckpt_cfg.resume:  # verified before anything starts or is written
                resume = self.ckpt.load()
                self._check_sampler(resume.sampler, dataset_len=False)
        self._to(RunState.PLACING)
        device = resolve_device(self.cluster.device)
        self.pool = WorkerPool(self.task, self.train, self.cluster, device)
        self.pool.start(self.target)
        ready = self.pool.wait_ready(self.cluster.min_workers, self.cluster.placement_timeout_s)
        if len(ready) < self.cluster.min_workers:
            raise placement_error(self.cluster.min_workers, len(ready) + self.pool.placed_but_starting(),
                                  device, self.cluster.placement_timeout_s)
        while self.pool.placed_but_starting() and len(ready) < self.target:  # placed: nearly ready
            ready += self.pool.wait_ready(1, self.cluster.placement_timeout_s)
        self._make_sampler(ready)
        if resume is not None:
            self._check_sampler(resume.sampler)
        logger.info("%d workers on %s; model has %d parameters; dataset has %d samples, %d steps per epoch",
                    len(ready), device, ready[0].info.num_params, self.sampler.dataset_len,
                    self.sampler.steps_per_epoch)
        self._to(RunState.FORMING)
        start = time.perf_counter()
        self._form(ready)
        self.recorder.event("group_formed", generation=self.generation, world_size=len(ready),
                            form_s=round(time.perf_counter() - start, 4))
        self._to(RunState.RESTORING)
        if resume is not None:
            self._load(resume, self.members)
            self.recorder.event("resumed", step=resume.step, saved_world_size=resume.world_size,
                                world_size=len(self.members))
        else:
            ray.get([m.actor.broadcast_state.remote(0) for m in self.members])
        self.recorder.weights("initial", ray.get(self.members[0].actor.model_state.remote()))

    def _make_sampler(self, ready: list[Member]) -> None:
        lengths = {m.info.dataset_len for m in ready}
        if len(lengths) != 1:
            raise TaskError(f"workers built datasets of different lengths {sorted(lengths)}: the dataset "
                            "factory must build the same dataset on every worker")
        self.sampler = ElasticSampler(lengths.pop(), global_batch=self.train.global_batch, seed=self.train.seed)

    def _form(self, members: list[Member]) -> None:
        """Form the next generation's collective group over ``members`` (ranks in list order)."""
        if self.store is None:
            self.store = dist.TCPStore(ray.util.get_node_ip_address(), 0, is_master=True,
                                       wait_for_workers=False, use_libuv=True)
        self.generation += 1
        host = ray.util.get_node_ip_address()
        ray.get([m.actor.configure_group.remote(host, self.store.port, self.generation, rank, len(members))
                 for rank, m in enumerate(members)])
        self.members = list(members)

    def _sampler_state(self) -> dict[str, int]:
        return {"seed": self.sampler.seed, "global_batch": self.sampler.global_batch,
                "dataset_len": self.sampler.dataset_len}

    def _check_sampler(self, saved: dict[str, int], *, dataset_len: bool = True) -> None:
        ours = {"global_batch": self.train.global_batch, "seed": self.train.seed}
        if dataset_len:
            ours["dataset_len"] = self.sampler.dataset_len
        flags = {"global_batch": "--global-batch", "seed": "--seed"}
        for key, value in ours.items():
            if saved[key] != value:
                fix = (f"resume with {flags[key]} {saved[key]}" if key in flags
                       else "resume with the dataset it was saved with")
                raise CheckpointError(f"the checkpoint was saved with {key}={saved[key]}, this run has "
                                      f"{value}: {fix} (a run's sample order depends on it)")

    def _load(self, state: TrainingState, members: list[Member]) -> None:
        ref = ray.put(state)
        ray.get([m.actor.load_state.remote(ref) for m in members])
        self.step = state.step

    # -- the step loop ---------------------------------------------------------------------
    def run_steps(self, count: int) -> None:
        """Run and commit steps until ``count`` more have committed, saving checkpoints when due."""
        target = self.step + count
        while self.step < target:
            self._step_boundary()
            if self._run_step(self.step):
                self.step += 1
                if self.ckpt is not None and self.ckpt_cfg.every and self.step % self.ckpt_cfg.every == 0:
                    self._save_checkpoint()

    def _step_boundary(self) -> None:
        """Between steps: start workers for due join faults, admit the ready ones."""
        joins = self.faults.joins_due(self.step)
        if joins:  # an injected join happens at its step: wait for the worker to be ready
            self.target = min(self.cluster.workers, self.target + joins)
            self.pool.start(joins)
            self.joiners += self.pool.wait_ready(joins, self.cluster.placement_timeout_s)
        self.joiners += self.pool.poll()
        decision = self.policy.at_step_boundary(self.members, self.joiners)
        if decision.action is Action.REFORM:
            self._to(RunState.RESIZING)
            start = time.monotonic()
            joined = [m for m in decision.members if m not in self.members]
            if self.train.zero:  # every chunk is live at this step: re-cut them for the new size
                self._reshard(list(decision.members), holders=self.members)
            else:
                self._change_membership(list(decision.members), source=self.members[0], needs_state=joined)
            self.recorder.event("membership_changed", cause=decision.reason, generation=self.generation,
                                world_size=len(self.members), joined=len(joined), lost=0,
                                reform_s=round(time.monotonic() - start, 4), steps_rerun=0,
                                ready_to_join_s=round(time.time() - min(m.info.ready_time for m in joined), 4))
            self._to(RunState.RUNNING)

    def _dispatch_step(self, step: int) -> StepOutcome:
        slices = split(self.sampler.batch(step), len(self.members))
        calls = {}
        for rank, (member, indices) in enumerate(zip(self.members, slices)):
            fault = self.faults.take(step, rank, ("forward", "allreduce", "optimizer", "snapshot"))
            calls[member.actor.step.remote(step, indices, fault)] = member
        return gather(calls, deadline_s=self.cluster.step_timeout_s, grace_s=self.cluster.abort_grace_s,
                      abort=self._abort)

    def _abort(self, members: list[Member]) -> None:
        for m in members:
            m.actor.abort_group.remote()  # control thread; a hung worker never runs it

    def _run_step(self, step: int) -> bool:
        """Run ``step`` until it commits; False when the run went back to an earlier step (a
        checkpoint, or a ZeRO snapshot older than ``step``)."""
        start = time.perf_counter()
        while True:
            outcome = self._dispatch_step(step)
            if outcome.committed_everywhere:
                self._record(step, list(outcome.results.values()), time.perf_counter() - start)
                return True
            if outcome.task_errors and not outcome.lost:
                raise outcome.task_errors[0]
            committed = self._recover(step, outcome)
            if committed is None:
                return False
            if committed:
                results = ([r for r in outcome.results.values() if r.committed]
                           or [r for r in outcome.results.values() if r.samples])  # ZeRO: gather failed
                self._record(step, results, time.perf_counter() - start)
                return True

    def _record(self, step: int, results: list[StepResult], seconds: float) -> None:
        samples = sum(r.samples for r in results)
        loss = sum(r.loss_sum for r in results) / samples
        timings = {k: round(max(r.timings.get(k, 0.0) for r in results), 6) for k in results[0].timings}
        # every sample of the step was trained (the gradients of a rank lost after the vote
        # were in the all-reduce), even when fewer results came back
        self.recorder.step(step=step, loss=loss, samples=self.train.global_batch, step_s=seconds,
                           world_size=len(self.members), generation=self.generation, timings=timings)

    # -- failures --------------------------------------------------------------------------
    def _recover(self, step: int, outcome: StepOutcome) -> bool | None:
        """Re-form after a failed step. True: the step had committed (stage 0: on a survivor,
        whose state is spread); False: re-run the step; None: the run went back to an earlier
        step, ``self.step`` (a checkpoint, or a ZeRO snapshot)."""
        self._to(RunState.RECOVERING)
        start = time.monotonic()
        lost_ranks = sorted(self.members.index(m) for m in outcome.lost)
        for member in outcome.lost:
            self.pool.stop(member)
        survivors = [m for m in self.members if m not in outcome.lost]
        committed = [m for m in survivors if outcome.results[m].committed]
        self.pool.start(self.policy.wanted(len(survivors), len(self.pool.pending) + len(self.joiners)))
        logger.warning("gen %d step %d: %s; lost ranks %s", self.generation, step, outcome.cause, lost_ranks)
        decision = self._decide_after_failure(step, survivors)
        if decision.action is Action.RESTORE:
            self._restore(list(decision.members), outcome, decision.reason, lost_ranks, start, step)
            return None
        if self.train.zero:
            return self._recover_sharded(step, outcome, list(decision.members), survivors, decision.reason,
                                         lost_ranks, start)
        members = list(decision.members)
        source = committed[0] if committed else survivors[0]
        needs = [m for m in members if m not in survivors or (committed and m not in committed)]
        try:
            self._change_membership(members, source=source, needs_state=needs)
        except ray.exceptions.RayActorError as exc:
            # Some members may already hold the source's state and others not; rather than
            # guess, stop here: committed checkpoints are intact.
            raise MembershipError(f"a worker failed while generation {self.generation + 1} was being formed "
                                  f"({exc.__class__.__name__}); restart with --resume to continue from the "
                                  "latest checkpoint") from None
        self._event_changed(outcome, decision.reason, lost_ranks, start, steps_rerun=0 if committed else 1)
        self._to(RunState.RUNNING)
        return bool(committed)

    def _restore(self, members: list[Member], outcome: StepOutcome, reason: str, lost_ranks: list[int],
                 start: float, step: int) -> None:
        """Restart ``members`` from the latest durable checkpoint."""
        state = self.ckpt.load()
        self.joiners = [j for j in self.joiners if j not in members]
        self._form(members)
        self._load(state, self.members)
        self.recorder.rewind(state.step)
        self._event_changed(outcome, reason, lost_ranks, start, steps_rerun=step - state.step + 1,
                            kind="restored_from_checkpoint", step=state.step)
        self._to(RunState.RUNNING)

    def _recover_sharded(self, step: int, outcome: StepOutcome, members: list[Member], survivors: list[Member],
                         reason: str, lost_ranks: list[int], start: float) -> bool | None:
        """Re-form after a failed step under ZeRO (``_recover``'s contract)."""
        try:
            plan = self._reshard(members, holders=survivors)
        except ray.exceptions.RayActorError as exc:
            raise MembershipError(f"a worker failed while generation {self.generation + 1} was being formed "
                                  f"({exc.__class__.__name__}); restart with --resume to continue from the "
                                  "latest checkpoint") from None
        if plan is None:
            lost = f"ranks {lost_ranks} of {len(self.members)} were lost together"
            if self.ckpt is None or self.ckpt.latest() is None:
                raise MembershipError(f"{lost}, and with them a ZeRO shard and its only peer snapshot, and there "
                                      "is no durable checkpoint: pass --checkpoint-dir and --checkpoint-every so a "
                                      "run can recover from this")
            logger.warning("gen %d step %d: %s, and with them a ZeRO shard and its peer snapshot: restarting "
                           "from the latest checkpoint", self.generation, step, lost)
            self._restore(members, outcome, f"{lost}, and with them a ZeRO shard and its peer snapshot",
                          lost_ranks, start, step)
            return None
        self._event_changed(outcome, reason, lost_ranks, start, steps_rerun=step + 1 - plan.step,
                            restored_step=plan.step)
        self._to(RunState.RUNNING)
        if plan.step == step + 1:
            return True  # the step committed everywhere before the failure
        self.step = plan.step
        self.recorder.rewind(plan.step)
        return False if plan.step == step else None

    def _reshard(self, members: list[Member], holders: list[Member]) -> ShardPlan | None:
        """Form the next generation over ``members`` and re-cut the ZeRO chunks that ``holders``
        (members of the current generation) hold; None when some chunk is lost."""
        old = list(self.members)
        reports = ray.get([m.actor.shard_holdings.remote() for m in holders])
        plan = shard_sources(len(old), {old.index(m): r for m, r in zip(holders, reports)})
        if plan is None:
            return None
        refs = [old[holder].actor.export_shard.remote(kind, plan.step) for holder, kind in plan.sources]
        ray.wait(refs, num_returns=len(refs))  # exported before the holders join the next generation
        self.joiners = [j for j in self.joiners if j not in members]
        self._form(members)
        ray.get([m.actor.import_shards.remote(refs, len(old), plan.step) for m in members])
        return plan

    def _decide_after_failure(self, step: int, survivors: list[Member]) -> MembershipDecision:
        """Ask the policy until it stops saying WAIT; raise when it says FAIL."""
        waited_since, warned = time.monotonic(), False
        has_ckpt = self.ckpt is not None and self.ckpt.latest() is not None  # none is written meanwhile
        while True:
            self.joiners += self.pool.poll()
            decision = self.policy.after_failure(survivors, self.joiners, waited_s=time.monotonic() - waited_since,
                                                 has_checkpoint=has_ckpt)
            if decision.action is Action.FAIL:
                raise MembershipError(decision.reason)
            if decision.action is not Action.WAIT:
                return decision
            if not warned:
                logger.warning("gen %d step %d: %s", self.generation, step, decision.reason)
                warned = True
            time.sleep(0.2)

    def _change_membership(self, members: list[Member], *, source: Member, needs_state: list[Member]) -> None:
        """Form the next generation over ``members`` and copy ``source``'s state to ``needs_state``."""
        if needs_state:  # through Ray's object store: joiners have no optimizer state to broadcast into
            ref = source.actor.training_state.remote(self.step, self._sampler_state())
            ray.get([m.actor.load_state.remote(ref) for m in needs_state])
        self.joiners = [j for j in self.joiners if j not in members]
        self._form(members)

    def _event_changed(self, outcome: StepOutcome, reason: str, lost_ranks: list[int], start: float,
                       steps_rerun: int, kind: str = "membership_changed", **extra) -> None:
        self.recorder.event(kind, **extra, cause=outcome.cause, decision=reason,
                            generation=self.generation, world_size=len(self.members), lost=len(outcome.lost),
                            lost_ranks=lost_ranks, detect_s=round(outcome.detect_s or 0.0, 4),
                            reform_s=round(time.monotonic() - start, 4), steps_rerun=steps_rerun)

    # -- checkpoints and the end -----------------------------------------------------------
    def _save_checkpoint(self) -> bool:
        """Save the state after ``self.step`` steps; False when a failure meanwhile sent the
        run back to an earlier step (the save happens again when the run gets here)."""
        while True:
            start = time.perf_counter()
            fault = self.faults.take(self.step - 1, 0, ("checkpoint",))
            # stage 0: rank 0 holds everything; ZeRO: every rank holds a part
            members = self.members if self.train.zero else self.members[:1]
            refs = [m.actor.training_state.remote(self.step, self._sampler_state(), fault if i == 0 else None)
                    for i, m in enumerate(members)]
            parts, lost = [], []
            for member, ref in zip(members, refs):
                try:
                    parts.append(ray.get(ref))
                except ray.exceptions.RayActorError:
                    lost.append(member)
            if not lost:
                break
            outcome = StepOutcome(results={m: StepResult(step=self.step - 1, rank=i, generation=self.generation,
                                                         committed=True)
                                           for i, m in enumerate(self.members) if m not in lost},
                                  lost=lost, cause=f"{lost!r} died while saving a checkpoint", detect_s=0.0)
            if self._recover(self.step - 1, outcome) is not True:
                return False  # back at an earlier step: nothing new to save
        state = merge_shards(parts) if self.train.zero else parts[0]
        path = self.ckpt.save(state)
        self.recorder.event("checkpoint_saved", step=self.step, path=str(path),
                            save_s=round(time.perf_counter() - start, 4))
        return True

    def _finish(self) -> bool:
        """The final checkpoint and output; False when the run has steps to re-run first."""
        due = self.ckpt is not None and (not self.ckpt_cfg.every or self.step % self.ckpt_cfg.every)
        if due and not self._save_checkpoint():
            return False
        rank0 = self.members[0].actor
        self.recorder.weights("final", ray.get(rank0.model_state.remote()))
        self.recorder.summary.sample = ray.get(rank0.sample.remote())
        return True
