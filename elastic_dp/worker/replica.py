"""The replica core: one model replica, its data and its optimizer, and the state through
the strategy. It knows nothing of Ray, nor of which mode trains it: the mode's
worker-side program (``elastic_dp.modes.<mode>.program``)
drives it, and ``WorkerActor`` wraps both as a threaded Ray actor.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch

from elastic_dp.comm.batchnorm import GlobalBatchStats, batch_norm_modules
from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.config import TrainConfig
from elastic_dp.data import micro_batches
from elastic_dp.data.ahead import Horizon
from elastic_dp.durable.checkpoint import Checkpoint, Part, TrainingState
from elastic_dp.errors import ElasticDPError, TaskError, WorkerError
from elastic_dp.faults import FaultHook
from elastic_dp.messages import Progress, StepResult, WorkerInfo
from elastic_dp.schedules import LearningRates
from elastic_dp.state.base import Strategy
from elastic_dp.state.stages import make_strategy
from elastic_dp.state.units import GENERATORS, UnitInit, build_on_meta, checkpoint_units, model_units
from elastic_dp.task import Task, kept_in_fp32, trainable

logger = logging.getLogger(__name__)

Batches = list[tuple[int, Any]]
"""A slice's micro-batches: (samples, collated batch)."""


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch  # collated on the CPU already
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def pinned(batch: Any) -> Any:
    """``batch`` with its tensors in pinned host memory (a copy to the GPU can then overlap)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, (list, tuple)):
        return type(batch)(pinned(b) for b in batch)
    if isinstance(batch, dict):
        return {k: pinned(v) for k, v in batch.items()}
    return batch


def portable(exc: BaseException, rank: int, step: int) -> BaseException:
    """An exception that pickles across the actor boundary and keeps the cause's text."""
    if isinstance(exc, ElasticDPError):
        return exc
    text = "".join(traceback.format_exception(exc)).rstrip()
    return WorkerError(f"worker rank {rank} failed at step {step}: {type(exc).__name__}: {exc}\n{text}",
                       rank=rank, step=step)


class Replica:
    """A model replica: the task's model, dataset and optimizer, and the strategy that
    holds their state. ``faults``: the process's fault hook (its phases are in here, the
    strategy and the programs)."""

    def __init__(self, task: Task, config: TrainConfig, device: torch.device,
                 group: CollectiveGroup, faults: FaultHook | None = None) -> None:
        self.task, self.config, self.device, self.group = task, config, device, group
        self.faults = faults or FaultHook()
        with GENERATORS:
            torch.manual_seed(config.seed)
        self.model = build_on_meta(task.model, device) if config.init_by_units else task.model().to(device)
        self.units = model_units(self.model, task.shard_units)
        init = None
        if config.init_by_units:  # the rule of elastic_dp.state.units
            init = UnitInit(self.model, self.units, config.seed, task.init_module, device)
            with GENERATORS:
                torch.manual_seed(config.seed)
        if init is not None and not config.stage.shards_parameters:
            init.all()  # at stage 3 each unit when the first layout keeps its chunks of it
        self.dataset = task.dataset()
        self.eval_dataset = task.eval_dataset() if config.eval_every and task.eval_dataset is not None else None
        self.horizon = Horizon(self.dataset)
        """What the dataset is told it will read (``read_ahead``)."""
        if next(self.model.parameters(), None) is None:
            raise TaskError(f"the model Task.model built ({type(self.model).__name__}) has no parameters: there is "
                            "nothing to train; return the module whose parameters the optimizer steps")
        self.optimizer = task.optimizer(self.model)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TaskError(f"Task.optimizer returned {type(self.optimizer).__name__}, not a torch.optim.Optimizer: "
                            "the factory must return the optimizer it builds over model.parameters()")
        self.rates = LearningRates(task, config, self.optimizer)
        """Each param group's learning rate at each step (``elastic_dp.schedules``)."""
        kept = [m for _, m in kept_in_fp32(task, self.model, config.stage.keep_patterns)] \
            if config.stage.gathers_bf16 else []
        self.strategy: Strategy = make_strategy(self.model, self.optimizer, group, config, device, self.faults,
                                                self.units, init if config.stage.shards_parameters else None, kept)
        if config.activation_checkpointing:
            checkpoint_units(self.units)
        self.batch_norm = batch_norm_modules(self.model)
        self.batch_stats = (GlobalBatchStats(self.model, group)
                            if self.batch_norm and config.global_batch_stats else None)
        """``--batch-stats global``: the batch-norm modules normalise over the global batch."""
        self.progress = Progress()

    def info(self) -> WorkerInfo:
        return WorkerInfo(dataset_len=len(self.dataset), eval_len=len(self.eval_dataset or ()),
                          num_params=sum(p.numel() for p in self.model.parameters()),
                          num_trainable=sum(p.numel() for _, p in trainable(self.model, self.optimizer)),
                          ready_time=time.time(), buffers=tuple(self.strategy.buffers.names),
                          batch_norm=tuple(self.batch_norm))

    # -- state: the strategy owns it --------------------------------------------------------
    def broadcast_state(self, src: int) -> None:
        """Make this replica's state equal rank ``src``'s (a collective). With ZeRO the
        optimizer state starts empty; each rank then takes its chunk of the parameters."""
        self.strategy.settle()
        self.strategy.sync_from(src)

    def training_state(self, step: int, sampler: dict[str, int]) -> TrainingState:
        """This worker's state, copied: the whole of it at ZeRO stage 0 (for a joiner);
        with ZeRO only this rank's part of the optimizer state (``merge_parts`` joins them)."""
        state = self.strategy.training_state(step, sampler)
        self.add_scheduler(state.optimizer_meta, step)
        return state

    def checkpoint_part(self, step: int, sampler: dict[str, int]) -> Part:
        """This rank's share of a checkpoint, copied into host memory."""
        part = self.strategy.checkpoint_part(step, sampler)
        if part.meta:  # rank 0's: the manifest's optimizer entry
            self.add_scheduler(part.meta, step)
        return part

    def add_scheduler(self, meta: dict[str, Any], step: int) -> None:
        """``Task.scheduler``'s state after ``step`` steps, beside the optimizer's param groups
        (of a checkpoint part or a training state: a program that writes its own part adds it too)."""
        if self.rates.scheduler is not None:
            meta["scheduler"] = self.rates.scheduler.state(step)

    def load_state(self, state: TrainingState) -> None:
        """Load a whole (world-size-independent) training state; with ZeRO a collective."""
        self.strategy.load_state(state)
        self.load_scheduler(state)

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Read what this rank needs of ``checkpoint`` from its storage (every file checked
        against its sha256 before any collective), then load it."""
        self.load_scheduler(self.strategy.load_checkpoint(checkpoint))

    def load_scheduler(self, state: TrainingState) -> None:
        """Go on from the scheduler's state the training state carries (none there: the rates
        of a new scheduler, which are the same for one stepped as often)."""
        if self.rates.scheduler is not None and state.optimizer_meta.get("scheduler") is not None:
            self.rates.scheduler.load(state.optimizer_meta["scheduler"], state.step)

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.strategy.model_state()

    def settled_model(self) -> torch.nn.Module:
        """The model, once parameters the last step left in flight have arrived."""
        self.strategy.settle()
        return self.model

    # -- compute ------------------------------------------------------------------------------
    def evaluate(self, start: int, stop: int, passes: int = 0) -> tuple[float, int]:
        """The task's loss summed over eval samples ``start .. stop`` (each micro-batch's mean
        times its samples) and their count, in ``model.eval()`` mode without gradients;
        at least ``passes`` forwards (``Strategy.equal_passes``: the ones after the
        micro-batches repeat the last and count nothing)."""
        model = self.settled_model()
        total, samples = 0.0, 0
        model.eval()
        Horizon(self.eval_dataset).now(np.arange(start, stop))  # a reader of remote data fetches them together
        chunks = micro_batches(np.arange(start, stop), self.config.micro_batch or self.config.global_batch)
        try:
            with torch.no_grad():
                for i in range(max(len(chunks), passes)):
                    chunk = chunks[min(i, len(chunks) - 1)]
                    self.progress.tick()
                    self.faults.at("eval")
                    batch = to_device(self.task.collate([self.eval_dataset[int(j)] for j in chunk]), self.device)
                    with self._autocast():
                        loss = self.task.loss(model, batch)
                    if i < len(chunks):
                        total += float(loss) * len(chunk)
                        samples += len(chunk)
        finally:
            model.train()
        return total, samples

    def _autocast(self) -> torch.autocast:
        """bf16 autocast with ``--precision bf16``, else a no-op."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16")

    def read_ahead(self, step: int, slice_of: Callable[[int], np.ndarray], layout: Hashable) -> None:
        """Before ``step`` computes: name to the dataset the samples of the steps ahead, where
        it reads ahead (``elastic_dp.data.ahead.Horizon``); ``slice_of(s)`` is step ``s``'s
        slice for this worker in ``layout``. A naming that fails is let go: the read of the
        same samples raises it, in the step."""
        try:
            self.horizon.at(step, slice_of, layout, self.config.steps - 1)
        except Exception:  # the read reports it
            logger.debug("the dataset's read_ahead failed", exc_info=True)

    def collate(self, indices: np.ndarray) -> Batches:
        """The micro-batches of a slice, in pinned memory on a GPU (the slice named to the
        dataset first, where it reads ahead: its reads then go together)."""
        self.horizon.now(indices)
        batches = []
        for chunk in micro_batches(indices, self.config.micro_batch):
            batch = self.task.collate([self.dataset[int(j)] for j in chunk])
            batches.append((len(chunk), pinned(batch) if self.device.type == "cuda" else batch))
        return batches

    def forward_backward(self, batches: Batches, result: StepResult, vote: bool = True, passes: int = 0,
                         per: int | None = None) -> None:
        """Every micro-batch's forward and backward, the loss scaled by its share of the
        global batch (gradients are then sums over samples divided by it); ``vote``: the
        synchronous step's (the ballot hears of a non-finite loss, and the reduction starts
        in the last backward). ``passes``: run at least this many forwards and backwards
        (``Strategy.equal_passes``): the ones after the micro-batches repeat the last of them
        in ``eval()`` mode with the loss scaled by 0, so they add nothing but the collectives
        the other ranks' passes need. ``per``: the samples the loss is averaged over instead
        of the global batch (a DiLoCo replica's own slice)."""
        autocast = self._autocast()
        start = time.perf_counter()
        total = max(len(batches), passes)
        for i in range(total):
            padding = i >= len(batches)
            samples, host_batch = batches[min(i, len(batches) - 1)]
            self.progress.tick()
            self.faults.at("forward")
            batch = to_device(host_batch, self.device)
            if padding:  # nothing of it stays: no running statistics move (with micro-batches they are local)
                self.model.eval()
            forward = time.perf_counter()
            try:
                with autocast:
                    loss = self.task.loss(self.model, batch)
            finally:
                if padding:
                    self.model.train()
            forward = time.perf_counter() - forward
            last = i == total - 1
            if not padding:
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                    raise TaskError(f"the task's loss returned {shape}, expected a scalar floating-point "
                                    "tensor: return the mean loss over the batch (e.g. .mean())")
                value = float(loss.detach())
                if not math.isfinite(value):
                    result.loss_finite = False
                    if vote:
                        self.strategy.ballot.nonfinite()  # before the last bucket leaves with the ballot
                # a straggler: before its last gradients leave, so peers wait (the last
                # backward estimated at twice its forward)
                if last and self.faults.straggle(time.perf_counter() - start + 2 * forward):
                    self.progress.tick()
            if vote:
                self.strategy.counts_use(not padding)  # a pass that adds nothing uses no parameter
                (self.strategy.before_last_backward if last else self.strategy.before_backward)()
            (loss.reshape(()) * (0.0 if padding else samples / (per or self.config.global_batch))).backward()
            if vote and not last:
                self.strategy.after_backward()
            if padding:
                continue
            result.loss_sum += value * samples
            result.samples += samples
            self.progress.tick()
