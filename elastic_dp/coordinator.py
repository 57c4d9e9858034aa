"""The coordinator: the control plane of a synchronous run.

An explicit state machine::

    INITIALIZING -> PLACING -> FORMING -> RESTORING -> RUNNING -> FINISHED
                                                         (any) -> FAILED

It places the workers, hosts the rendezvous store, forms each generation's collective
group under its own prefix (DESIGN invariant 1), restores state (broadcast from rank 0,
or a checkpoint), and drives the steps: for step ``s`` it takes the sampler's global
batch, splits it into contiguous slices over the current ranks, and commits the step
when every worker reports it committed (DESIGN invariants 2 and 5). It never touches a
tensor: state moves between workers, checkpoints and the output directory as opaque
objects.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import ray
import torch.distributed as dist

from .actor import remote_worker_class
from .checkpoint import CheckpointStore, TrainingState
from .config import CheckpointConfig, ClusterConfig, TrainConfig, check_batch_fits
from .data import ElasticSampler, split
from .errors import CheckpointError, TaskError, WorkerError
from .messages import StepResult
from .metrics import RunRecorder, RunSummary
from .placement import Placement, place, resolve_device
from .task import Task

logger = logging.getLogger(__name__)


class RunState(enum.Enum):
    INITIALIZING = "initializing"
    PLACING = "placing"
    FORMING = "forming"
    RESTORING = "restoring"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(slots=True)
class Membership:
    """The workers of the current generation, in rank order."""

    generation: int = -1
    workers: list = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.workers)


class Coordinator:
    """Drives one run from placement to the last committed step."""

    def __init__(self, task: Task, train: TrainConfig, cluster: ClusterConfig,
                 checkpoint: CheckpointConfig, recorder: RunRecorder) -> None:
        check_batch_fits(train, cluster)
        self.task, self.train, self.cluster, self.ckpt_cfg = task, train, cluster, checkpoint
        self.recorder = recorder
        self.state = RunState.INITIALIZING
        self.members = Membership()
        self.ckpt = CheckpointStore(checkpoint.dir, keep=checkpoint.keep) if checkpoint.dir else None
        self.sampler: ElasticSampler | None = None
        self.placement: Placement | None = None
        self.store: dist.TCPStore | None = None
        self.step = 0

    def _to(self, state: RunState) -> None:
        logger.debug("coordinator: %s -> %s", self.state.value, state.value)
        self.state = state

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Place, form, restore, train every remaining step, and tear down."""
        try:
            self.start()
            self.run_steps(self.train.steps - self.step)
            self._finish()
            self._to(RunState.FINISHED)
            return self.recorder.finish()
        except BaseException:
            self._to(RunState.FAILED)
            raise
        finally:
            self.close()

    def start(self) -> None:
        """Place the workers, form generation 0 and restore state (checkpoint or rank 0)."""
        self._prepare()
        self._to(RunState.RUNNING)
        self.recorder.start(self.step)

    def close(self) -> None:
        """Stop the workers and release the placement group."""
        self._teardown()

    def _prepare(self) -> None:
        resume: TrainingState | None = None
        if self.ckpt is not None:
            self.ckpt.check_writable()
            if self.ckpt_cfg.resume:  # verified before anything starts or is written
                resume = self.ckpt.load()
                self._check_sampler(resume.sampler, dataset_len=False)
        self._to(RunState.PLACING)
        device = resolve_device(self.cluster.device)
        self.placement = place(self.cluster.workers, device, timeout_s=self.cluster.placement_timeout_s)
        workers = self._spawn(device)
        if resume is not None:
            self._check_sampler(resume.sampler)
        self._to(RunState.FORMING)
        self._form(workers)
        self._to(RunState.RESTORING)
        if resume is not None:
            self._restore(resume)
        else:
            ray.get([w.broadcast_state.remote(0) for w in self.members.workers])
        self.recorder.weights("initial", ray.get(self.members.workers[0].model_state.remote()))

    def _spawn(self, device: str) -> list:
        """Start one worker actor per placement bundle and build the task on each."""
        actor_cls = remote_worker_class()
        gpu = 1 if device == "cuda" else 0
        workers = [actor_cls.options(num_cpus=1, num_gpus=gpu, scheduling_strategy=self.placement.strategy(i))
                   .remote(device=device, num_threads=1, collective_timeout_s=self.cluster.collective_timeout_s)
                   for i in range(self.cluster.workers)]
        self.members = Membership(generation=-1, workers=workers)  # so teardown reaches them
        infos = ray.get([w.setup.remote(self.task, self.train, i) for i, w in enumerate(workers)])
        lengths = {info.dataset_len for info in infos}
        if len(lengths) != 1:
            raise TaskError(f"workers built datasets of different lengths {sorted(lengths)}: the dataset "
                            "factory must build the same dataset on every worker")
        self.sampler = ElasticSampler(lengths.pop(), global_batch=self.train.global_batch, seed=self.train.seed)
        logger.info("%d workers on %s; model has %d parameters; dataset has %d samples, %d steps per epoch",
                    len(workers), device, infos[0].num_params, self.sampler.dataset_len,
                    self.sampler.steps_per_epoch)
        return workers

    def _form(self, workers: list) -> None:
        """Form the next generation's collective group over ``workers`` (ranks in list order)."""
        start = time.perf_counter()
        if self.store is None:
            self.store = dist.TCPStore(ray.util.get_node_ip_address(), 0, is_master=True,
                                       wait_for_workers=False, use_libuv=True)
        generation = self.members.generation + 1
        host = ray.util.get_node_ip_address()
        ray.get([w.configure_group.remote(host, self.store.port, generation, rank, len(workers))
                 for rank, w in enumerate(workers)])
        self.members = Membership(generation=generation, workers=workers)
        self.recorder.event("group_formed", generation=generation, world_size=len(workers),
                            form_s=round(time.perf_counter() - start, 4))

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

    def _restore(self, state: TrainingState) -> None:
        start = time.perf_counter()
        ref = ray.put(state)
        ray.get([w.load_state.remote(ref) for w in self.members.workers])
        self.step = state.step
        self.recorder.event("resumed", step=state.step, saved_world_size=state.world_size,
                            world_size=self.members.world_size, load_s=round(time.perf_counter() - start, 4))

    # -- the step loop ---------------------------------------------------------------------
    def run_steps(self, count: int) -> None:
        """Run and commit the next ``count`` steps, saving checkpoints when due."""
        for _ in range(count):
            self._run_step(self.step)
            self.step += 1
            if self.ckpt is not None and self.ckpt_cfg.every and self.step % self.ckpt_cfg.every == 0:
                self._save_checkpoint()

    def _finish(self) -> None:
        if self.ckpt is not None and (not self.ckpt_cfg.every or self.step % self.ckpt_cfg.every):
            self._save_checkpoint()
        rank0 = self.members.workers[0]
        self.recorder.weights("final", ray.get(rank0.model_state.remote()))
        self.recorder.summary.sample = ray.get(rank0.sample.remote())

    def _run_step(self, step: int) -> None:
        start = time.perf_counter()
        slices = split(self.sampler.batch(step), self.members.world_size)
        refs = [w.step.remote(step, s) for w, s in zip(self.members.workers, slices)]
        try:
            results: list[StepResult] = ray.get(refs, timeout=self.cluster.step_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"step {step} did not finish within {self.cluster.step_timeout_s:.0f} s: "
                              "raise --step-timeout if steps are this slow", step=step) from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerError(f"a worker died during step {step}: {exc}", step=step) from None
        if not all(r.committed for r in results):
            errors = [r.error for r in results if r.error is not None]
            if errors:
                raise errors[0]
            raise WorkerError(f"step {step} did not commit on every worker", step=step)
        samples = sum(r.samples for r in results)
        loss = sum(r.loss_sum for r in results) / samples
        timings = {k: round(max(r.timings[k] for r in results), 6) for k in results[0].timings}
        self.recorder.step(step=step, loss=loss, samples=samples, step_s=time.perf_counter() - start,
                           world_size=self.members.world_size, generation=self.members.generation,
                           timings=timings)

    def _save_checkpoint(self) -> None:
        start = time.perf_counter()
        state = ray.get(self.members.workers[0].training_state.remote(self.step, self._sampler_state()))
        path = self.ckpt.save(state)
        self.recorder.event("checkpoint_saved", step=self.step, path=str(path),
                            save_s=round(time.perf_counter() - start, 4))

    def _teardown(self) -> None:
        # Killing the actors releases their process groups with them; a graceful destroy
        # could block behind a collective that a failed step left running.
        for w in self.members.workers:
            ray.kill(w)
        self.members = Membership(generation=self.members.generation)
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        self.store = None
