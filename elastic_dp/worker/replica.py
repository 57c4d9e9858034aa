"""The worker: one model replica, its data, its optimizer, and the step.

``Replica`` holds the data-plane logic and knows nothing of Ray; ``WorkerActor`` wraps
it as a threaded Ray actor (``max_concurrency=3``) so that a control call can reach the
worker while its training thread is blocked in a collective.

A step records errors instead of raising them: a worker whose forward failed still takes
part in the step's collectives (with zero gradients), then every rank votes; the update
is applied only when every vote is clean (record, gate, commit). No rank is left waiting
in a collective because a peer raised, and no worker exposes a half-applied step. The
vote also carries whether every loss and gradient is finite: when one is not, every rank
skips the update alike (the step counts, as a no-op), and the coordinator decides
whether the run goes on (``--on-nonfinite``).
"""

from __future__ import annotations

import functools
import logging
import math
import time
import traceback
from typing import Any, Iterator

import numpy as np
import torch

from elastic_dp.durable.checkpoint import Checkpoint, Part, TrainingState, cut_part
from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.config import TrainConfig
from elastic_dp.data import ElasticSampler, micro_batches, rank_slice
from elastic_dp.errors import CollectiveError, ElasticDPError, TaskError, WorkerError
from elastic_dp.faults import Fault, trigger
from elastic_dp.worker.window import Grants, Prefetcher
from elastic_dp.messages import Progress, StepResult, WindowPlan, WorkerInfo
from elastic_dp.state.zero.chunks import check_shardable
from elastic_dp.state import Strategy, make_strategy
from elastic_dp.task import Task, trainable

logger = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.5
"""In a window a worker reports its committed steps at most this often (its first step, a
failure, the end of its grant and the end of the window at once): short steps are
reported many at a time. Every report costs CPU in the worker and the driver (Ray's streaming machinery),
which on a machine whose cores they share is taken from the training threads; nothing
waits for a report, since grants run ``window.LOOKAHEAD_S`` ahead and a join ends the
window through the vote (``loop.Grants.stopping``)."""


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch  # collated on the CPU already
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _pinned(batch: Any) -> Any:
    """``batch`` with its tensors in pinned host memory (a copy to the GPU can then overlap)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, (list, tuple)):
        return type(batch)(_pinned(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _pinned(v) for k, v in batch.items()}
    return batch


def _portable(exc: BaseException, rank: int, step: int) -> BaseException:
    """An exception that pickles across the actor boundary and keeps the cause's text."""
    if isinstance(exc, ElasticDPError):
        return exc
    text = "".join(traceback.format_exception(exc)).rstrip()
    return WorkerError(f"worker rank {rank} failed at step {step}: {type(exc).__name__}: {exc}\n{text}",
                       rank=rank, step=step)


class Replica:
    """A model replica and its synchronous data-parallel step."""

    def __init__(self, task: Task, config: TrainConfig, device: torch.device,
                 group: CollectiveGroup) -> None:
        self.task, self.config, self.device, self.group = task, config, device, group
        torch.manual_seed(config.seed)
        self.model = task.model().to(device)
        self.dataset = task.dataset()
        self.optimizer = task.optimizer(self.model)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        if config.mode == "async":  # its parameter servers shard the optimizer state, as ZeRO does
            check_shardable(self.optimizer, "async")
        self.strategy: Strategy = make_strategy(self.model, self.optimizer, group, config, device)
        self.progress = Progress()
        self.grants = Grants()
        self.prefetcher = Prefetcher(self._collate)
        self.prefetch = config.prefetch if config.prefetch is not None else device.type == "cuda"
        self.slow: Fault | None = None
        """The straggler fault slowing the current step (``--inject slow``), if any."""

    def info(self) -> WorkerInfo:
        return WorkerInfo(dataset_len=len(self.dataset),
                          num_params=sum(p.numel() for p in self.model.parameters()),
                          num_trainable=sum(p.numel() for _, p in trainable(self.model, self.optimizer)),
                          ready_time=time.time())

    # -- state ---------------------------------------------------------------------------
    def broadcast_state(self, src: int) -> None:
        """Make this replica's state equal rank ``src``'s (a collective). With ZeRO the
        optimizer state starts empty; each rank then takes its chunk of the parameters."""
        self.strategy.settle()
        self.strategy.sync_from(src)

    def training_state(self, step: int, sampler: dict[str, int]) -> TrainingState:
        """This worker's state, copied: the whole of it at ZeRO stage 0 (for a joiner);
        with ZeRO only this rank's part of the optimizer state (``merge_shards`` joins them)."""
        self.strategy.settle()
        tensors, meta = self.strategy.state_part()
        return TrainingState(step=step, model=self.model_state(),
                             optimizer_tensors={k: v.detach().to("cpu", copy=True) for k, v in tensors.items()},
                             optimizer_meta=meta, sampler=sampler, world_size=self.group.world_size,
                             rng=torch.get_rng_state())

    def checkpoint_part(self, step: int, sampler: dict[str, int]) -> Part:
        """This rank's share of a checkpoint, copied into host memory: only the pieces it
        writes are copied (``checkpoint.cut_part``)."""
        self.strategy.settle()
        tensors, meta = self.strategy.state_part()
        live = TrainingState(step=step, model=self.model.state_dict(), optimizer_tensors=tensors,
                             optimizer_meta=meta, sampler=sampler, world_size=self.group.world_size,
                             rng=torch.get_rng_state())
        return cut_part(live, self.group.rank, self.group.world_size)

    def load_state(self, state: TrainingState) -> None:
        """Load a whole (world-size-independent) training state; with ZeRO a collective."""
        self.strategy.settle()  # no gather still in flight may overwrite what is loaded
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.model.items()})
        self.strategy.load(state)
        torch.set_rng_state(state.rng)

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Read what this rank needs of ``checkpoint`` from its storage (every file checked
        against its sha256 before any collective), then load it."""
        self.load_state(checkpoint.read(self.strategy.wanted()))

    def model_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.settled_model().state_dict().items()}

    def settled_model(self) -> torch.nn.Module:
        """The model, once parameters the last step left in flight have arrived."""
        self.strategy.settle()
        return self.model

    # -- the step ------------------------------------------------------------------------
    def _collate(self, indices: np.ndarray) -> list[tuple[int, Any]]:
        """The micro-batches of a slice: (samples, collated batch), in pinned memory on a GPU."""
        batches = []
        for chunk in micro_batches(indices, self.config.micro_batch):
            batch = self.task.collate([self.dataset[int(j)] for j in chunk])
            batches.append((len(chunk), _pinned(batch) if self.device.type == "cuda" else batch))
        return batches

    def _forward_backward(self, batches: list[tuple[int, Any]], result: StepResult, fault: Fault | None,
                          vote: bool = True) -> None:
        """Every micro-batch's forward and backward; ``vote``: the synchronous step's (the
        strategy hears of a non-finite loss, and its reduction starts in the last backward)."""
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16,
                                  enabled=self.config.precision == "bf16")
        start = time.perf_counter()
        for i, (samples, host_batch) in enumerate(batches):
            self.progress.tick()
            trigger(fault, "forward")
            batch = _to_device(host_batch, self.device)
            forward = time.perf_counter()
            with autocast:
                loss = self.task.loss(self.model, batch)
            forward = time.perf_counter() - forward
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise TaskError(f"the task's loss returned {shape}, expected a scalar floating-point "
                                "tensor: return the mean loss over the batch (e.g. .mean())")
            value = float(loss.detach())
            if not math.isfinite(value):
                result.loss_finite = False
                if vote:
                    self.strategy.note_nonfinite()  # the commit vote: before the last bucket leaves
            if i == len(batches) - 1:
                if self.slow is not None:  # a straggler: before its last gradients leave, so peers wait
                    self._straggle(time.perf_counter() - start + 2 * forward)
                if vote:
                    self.strategy.before_last_backward()
            (loss.reshape(()) * (samples / self.config.global_batch)).backward()
            result.loss_sum += value * samples
            result.samples += samples
            self.progress.tick()

    def _straggle(self, compute_s: float) -> None:
        """``--inject slow``: make a step whose compute takes ``compute_s`` (the last
        backward estimated at twice its forward) take ``factor`` times as long."""
        time.sleep((self.slow.factor - 1) * compute_s)
        self.progress.tick()

    def step(self, step: int, indices: np.ndarray, fault: Fault | None = None,
             batches: list[tuple[int, Any]] | None = None) -> StepResult:
        """Train one step on this worker's slice ``indices`` of the global batch
        (``batches``: its micro-batches, when prepared ahead).

        ``fault`` (fault injection) is carried out in its phase of this step.
        """
        try:
            return self._step(step, indices, fault, batches)
        finally:
            self.progress.enter("idle")

    def run_window(self, plan: WindowPlan) -> Iterator[list[StepResult]]:
        """Train the steps the coordinator grants, from ``plan.start``, until the window
        ends (the last grant reached, an abort, or a step whose vote carried the
        coordinator's request to stop) or a step does not commit. Results are
        reported every ``REPORT_INTERVAL_S`` (the window's first step at once: the coordinator
        judges hangs by the pace of the steps it has heard of), and at once when a step did
        not commit or the grant runs out. Each step's slice is computed here, and the next one's
        collated ahead."""
        sampler = ElasticSampler(plan.sampler["dataset_len"], global_batch=plan.sampler["global_batch"],
                                 seed=plan.sampler["seed"])
        rank, world, generation = self.group.rank, self.group.world_size, self.group.generation

        def slice_of(step: int) -> np.ndarray:
            return rank_slice(sampler.batch(step), world, rank, self.grants.sizes(step))

        self.grants.open(plan)
        step, report = plan.start, []
        last, reported = time.perf_counter(), -math.inf  # the first step at once: the watchdog's pace
        while True:
            if report and (last - reported >= REPORT_INTERVAL_S or not self.grants.granted(step)):
                yield report  # before waiting for a grant: the coordinator grants on reports
                report, reported = [], last
            if not self.grants.wait_for(step):
                break
            indices = slice_of(step)
            try:  # keyed by the slice's bounds too: --balance may change them from a step on
                batches = self.prefetcher.take((generation, step, rank, world, self.grants.sizes(step)), indices)
            except Exception as exc:  # the task's dataset or collate raised: the step records it
                batches = exc
            if self.prefetch and self.grants.granted(step + 1):
                self.prefetcher.submit((generation, step + 1, rank, world, self.grants.sizes(step + 1)),
                                       slice_of(step + 1))
            self.slow = plan.slow if plan.slow is not None and plan.slow.slows(step) else None
            try:
                result = self.step(step, indices, self.grants.fault(step), batches)
            except Exception:  # a bug: the steps committed before it are reported, then it
                if report:
                    yield report
                raise
            now = time.perf_counter()
            result.step_s, result.time, last = now - last, time.time(), now
            report.append(result)
            if not result.committed or result.stop:  # a stop: every rank's tally said so
                break
            step += 1
        self.slow = None
        if report:
            yield report

    def async_gradient(self, indices: np.ndarray, pieces: list[np.ndarray], bounds: list[int],
                       fault: Fault | None, slow: Fault | None) -> tuple[dict, list[np.ndarray]]:
        """``--mode async``: the gradient of a whole step's batch ``indices`` on the
        parameters ``pieces`` (the shards' flat fp32 pieces of one version), clipped by its
        own norm, cut at ``bounds`` into one flat piece per shard. Also a small report: loss,
        whether loss and gradient are finite, the error of the task if it raised.

        Pieces travel as NumPy arrays, which Ray reads from its object store without a
        copy (torch tensors it would unpickle into new memory): the pulled pieces are read
        in place, and each returned piece is a view of one host copy of the gradient."""
        params = [p for _, p in trainable(self.model, self.optimizer)]
        flat = torch.empty(bounds[-1], dtype=torch.float32)
        for piece, lo, hi in zip(pieces, bounds, bounds[1:]):
            np.copyto(flat.numpy()[lo:hi], piece)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        if not self.model.training:
            self.model.train()
        self.strategy.zero_grad()  # the gradients live in its buckets; no collective is used
        report = {"error": None, "finite": True, "loss": None, "grad_norm": None, "compute_s": 0.0}
        result = StepResult(step=0, rank=0, generation=0, committed=False)
        start = time.perf_counter()
        self.slow = slow
        self.progress.enter("compute")  # the watchdog judges a stalled gradient by this phase
        try:
            self._forward_backward(self._collate(indices), result, fault, vote=False)
        except Exception as exc:
            report["error"] = _portable(exc, 0, -1)
            return report, [np.zeros(0, dtype=np.float32) for _ in bounds[1:]]
        finally:
            self.slow = None
            self.progress.enter("idle")
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.config.clip_grad_norm is not None:
            report["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, self.config.clip_grad_norm))
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat_grad = torch.cat([g.detach().reshape(-1).float() for g in grads]).cpu()
        report["finite"] = result.loss_finite and bool(torch.isfinite(flat_grad).all())
        report["loss"] = result.loss_sum / max(1, result.samples)
        report["compute_s"] = time.perf_counter() - start
        host = flat_grad.numpy()  # Ray writes each view's own bytes into its store, no more
        return report, [host[lo:hi] for lo, hi in zip(bounds, bounds[1:])]

    def _step(self, step: int, indices: np.ndarray, fault: Fault | None,
              batches: list[tuple[int, Any]] | BaseException | None) -> StepResult:
        result = StepResult(step=step, rank=self.group.rank, generation=self.group.generation,
                            committed=False)
        if not self.model.training:
            self.model.train()
        self.strategy.zero_grad()
        # as the last bucket leaves with the vote: a fault of phase allreduce fires, and a
        # request to end the window heard by then (during this step too) goes with the vote
        self.strategy.reducer.before_vote = functools.partial(self._before_vote, fault)
        self.progress.enter("compute")
        t0 = time.perf_counter()
        local_error: BaseException | None = None
        try:
            if isinstance(batches, BaseException):
                raise batches
            self._forward_backward(batches if batches is not None else self._collate(indices), result, fault)
        except Exception as exc:  # recorded; the vote below tells every rank
            local_error = exc
        t1 = time.perf_counter()
        parameter_wait = self.strategy.take_parameter_wait_s()
        self.progress.enter("reduce")
        vote = self._reduce_and_vote(step, result, local_error, fault)
        if vote is None:
            return result  # the group failed: result.error says how
        result.stop = vote[2] > 0
        t2 = time.perf_counter()
        self.progress.enter("update")
        if local_error is not None or vote[0] > 0:
            result.error = _portable(local_error, result.rank, step) if local_error else None
            self.strategy.zero_grad()
            return result
        try:
            if vote[1] > 0:  # a loss or gradient is not finite somewhere: every rank skips the update
                result.nonfinite = True
                self.strategy.zero_grad()
                self.strategy.skip_update(step)
            else:
                self._update(step, result, fault)
            t3 = time.perf_counter()
            self.strategy.after_commit(step + 1, fault)
        except CollectiveError as exc:  # ZeRO-2's norm, the parameter gather or the snapshot: a peer
            # was lost after the vote; whether this chunk was updated, shard_holdings tells
            result.error = exc
            return result
        t4 = time.perf_counter()
        result.committed = True
        result.timings = {"compute_s": t1 - t0 - parameter_wait, "reduce_wait_s": t2 - t1, "optimizer_s": t3 - t2,
                          "snapshot_s": t4 - t3}
        if self.config.zero:  # the forward's wait for the parameters' all-gathers
            result.timings["parameter_wait_s"] = parameter_wait
        return result

    def _before_vote(self, fault: Fault | None) -> None:
        trigger(fault, "allreduce")
        if self.grants.stopping():  # asked to end the window: the vote tells every rank
            self.strategy.note_stop()

    def _reduce_and_vote(self, step: int, result: StepResult, local_error: BaseException | None,
                         fault: Fault | None) -> torch.Tensor | None:
        """Complete the gradient reduction, which carries the commit vote: [ranks with an
        error, ranks that saw a non-finite loss or gradient]. None when the group failed."""
        try:
            if local_error is not None:
                self.strategy.note_error()
                self.strategy.before_last_backward()  # keep collectives in lockstep
            return self.strategy.reduce_gradients()
        except Exception as exc:  # the group itself failed: no vote is possible
            self.strategy.abandon()
            result.error = local_error and _portable(local_error, result.rank, step)
            result.error = result.error or CollectiveError(
                f"gen {result.generation} rank {result.rank} step {step}: collective failed: {exc}",
                rank=result.rank, step=step)
            return None

    def _update(self, step: int, result: StepResult, fault: Fault | None) -> None:
        """Apply the committed step's update: clip, learning rate, optimizer."""
        if self.config.clip_grad_norm is not None:
            result.grad_norm = self.strategy.clip_grad_norm(self.config.clip_grad_norm)
        trigger(fault, "optimizer")
        factor = self.config.lr_factor(step)
        for group, base in zip(self.strategy.param_groups, self.base_lrs):
            group["lr"] = base * factor
        result.lr = self.strategy.param_groups[0]["lr"]
        self.strategy.optimizer_step(step)
