"""Synchronous data parallelism, worker side: windows of steps, the step, the commit.

A step records errors instead of raising them: a worker whose forward failed still takes
part in the step's collectives (with zero gradients), then every rank votes; the update
is applied only when every vote is clean (record, gate, commit; ``elastic_dp.comm.vote``).
No rank is left waiting in a collective because a peer raised, and no worker exposes a
half-applied step. The vote also carries whether every loss and gradient is finite: when
one is not, every rank skips the update alike (the step counts, as a no-op), and the
coordinator decides whether the run goes on (``--on-nonfinite``).

The steps run in windows that the coordinator grants (``elastic_dp.modes.sync.grants``): the
program computes each step's slice itself and collates the next one's ahead. The driver
half (``.mode``, ``.window``) calls ``run_window`` (a stream) and ``grant``.
"""

from __future__ import annotations

import math
import time
from typing import Iterator

import numpy as np

from elastic_dp.comm.vote import Vote
from elastic_dp.data import ElasticSampler, rank_slice
from elastic_dp.durable.checkpoint import REDUCTION, Checkpoint, Part, add_piece, part_files
from elastic_dp.errors import CollectiveError, peer_error
from elastic_dp.faults import Fault
from elastic_dp.messages import StepResult, WindowPlan
from elastic_dp.modes.program import Program
from elastic_dp.modes.sync.grants import Grants, Prefetcher
from elastic_dp.threads import set_os_name
from elastic_dp.worker.replica import Batches, Replica, portable

REPORT_INTERVAL_S = 0.5
"""In a window a worker reports its committed steps at most this often (its first step, a
failure, the end of its grant and the end of the window at once): short steps are
reported many at a time. Every report costs CPU in the worker and the driver (Ray's streaming machinery),
which on a machine whose cores they share is taken from the training threads; nothing
waits for a report, since grants run ``grants.LOOKAHEAD_S`` ahead and a join ends the
window through the vote (``grants.Grants.stopping``)."""


class SyncProgram(Program):
    """The synchronous mode's worker side, over a ``Replica``."""

    calls = frozenset({"grant", "reduction_holdings"})
    streams = frozenset({"run_window"})

    def __init__(self, replica: Replica) -> None:
        super().__init__(replica)
        self.grants = Grants()
        self.prefetcher = Prefetcher(replica.collate)
        config = replica.config
        self.prefetch = config.mode.prefetch if config.mode.prefetch is not None else replica.device.type == "cuda"
        self.buffers = replica.strategy.buffers
        self.agree_buffers = bool(self.buffers) and not config.global_batch_stats
        """Whether the ballot carries the buffers (under ``--batch-stats global`` they are
        equal on every rank already)."""
        self._share = 0.0  # this step's share of the global batch: its weight in the buffers' mean
        self._measured_generation: int | None = None  # the generation ``_state_bytes`` was measured in
        self._state_bytes: dict[str, int] | None = None

    def abort(self) -> None:
        """The group is being aborted: a window waiting for a grant ends."""
        self.grants.cancel()

    def leave(self) -> None:
        """Every window ends at the next step boundary (the coordinator lets this worker go there)."""
        self.grants.leave()

    def checkpoint_part(self, step: int, sampler: dict[str, int]) -> Part:
        """The replica's part, and this rank's row of its reduction's state (if it keeps one)."""
        part = super().checkpoint_part(step, sampler)
        group, file = self.replica.group, part_files(self.replica.group.rank)[1]
        for key, value in self.replica.strategy.reduction.state().items():
            part.files.setdefault(file, {})
            add_piece(part, file, f"optim/{REDUCTION}{key}", value, group.rank * value.numel(),
                      [group.world_size, *value.shape])
        return part

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """The replica's state, then the reduction's rows (``Reduction.load_rows``)."""
        super().load_checkpoint(checkpoint)
        keys = {k for k in checkpoint.manifest["tensors"] if k.startswith(f"optim/{REDUCTION}")}
        rows: dict = {}
        if keys:
            _, saved = checkpoint.read_ranges({}, whole=lambda k: k in keys or k == "rng")  # rng: a state's own
            rows = {k.removeprefix(REDUCTION): v for k, v in saved.optimizer_tensors.items() if k.startswith(REDUCTION)}
        group = self.replica.group
        self.replica.strategy.reduction.load_rows(rows, group.rank, group.world_size)

    def reduction_holdings(self) -> dict:
        """Control thread: what a re-formation must know of the reduction's state here
        (``Reduction.holdings``: a compressor's errors and their copies)."""
        return self.replica.strategy.reduction.holdings()

    def grant(self, window: int, until: int, final: bool, faults: dict[int, Fault],
              sizes: tuple[int, tuple[int, ...] | None] | None = None, stop: bool = False) -> None:
        """Control thread: let ``window`` run the steps before ``until`` (``final``: and no
        more); ``sizes``: (step, slice sizes) from which the slices change (``--balance``);
        ``stop``: end the window after the next step, which carries the request in its vote."""
        self.grants.extend(window, until, final, faults, sizes, stop)

    def step(self, step: int, indices: np.ndarray, batches: Batches | BaseException | None = None,
             sizes: tuple[int, ...] | None = None) -> StepResult:
        """Train one step on this worker's slice ``indices`` of the global batch
        (``batches``: its micro-batches, when prepared ahead; ``sizes``: every rank's slice
        size, when not the equal split). The faults armed for it fire at their phases; one
        whose phase the step did not reach is disarmed."""
        try:
            return self._step(step, indices, batches, sizes)
        finally:
            self.replica.faults.disarm()  # so that it does not fire in a later step
            self.replica.progress.enter("idle")

    def run_window(self, plan: WindowPlan) -> Iterator[list[StepResult]]:
        """Train the steps the coordinator grants, from ``plan.start``, until the window
        ends (the last grant reached, an abort, or a step whose vote carried the
        coordinator's request to stop) or a step does not commit. Results are
        reported every ``REPORT_INTERVAL_S`` (the window's first step at once: the coordinator
        judges hangs by the pace of the steps it has heard of), and at once when a step did
        not commit or the grant runs out. Each step's slice is computed here, and the next one's
        collated ahead."""
        set_os_name("edp-train")  # the thread Ray lends to this call (Ray names it back after)
        replica, grants = self.replica, self.grants
        sampler = ElasticSampler(plan.sampler["dataset_len"], global_batch=plan.sampler["global_batch"],
                                 seed=plan.sampler["seed"])
        group = replica.group
        rank, world, generation = group.rank, group.world_size, group.generation

        def slice_of(step: int) -> np.ndarray:
            return rank_slice(sampler.batch(step), world, rank, grants.sizes(step))

        grants.open(plan)
        step, report = plan.start, []
        last, reported = time.perf_counter(), -math.inf  # the first step at once: the watchdog's pace
        try:
            while True:
                if report and (last - reported >= REPORT_INTERVAL_S or not grants.granted(step)):
                    yield report  # before waiting for a grant: the coordinator grants on reports
                    report, reported = [], last
                if not grants.wait_for(step):
                    break
                indices = slice_of(step)
                replica.read_ahead(step, slice_of, (generation, rank, world, grants.sizes(step)))
                try:  # keyed by the slice's bounds too: --balance may change them from a step on
                    batches = self.prefetcher.take((generation, step, rank, world, grants.sizes(step)), indices)
                except Exception as exc:  # the task's dataset or collate raised: the step records it
                    batches = exc
                if self.prefetch and grants.granted(step + 1):
                    self.prefetcher.submit((generation, step + 1, rank, world, grants.sizes(step + 1)),
                                           slice_of(step + 1))
                replica.faults.slow = plan.slow if plan.slow is not None and plan.slow.slows(step) else None
                replica.faults.arm(grants.fault(step))  # granted with the step (--inject)
                try:
                    result = self.step(step, indices, batches, grants.sizes(step))
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
        finally:
            replica.faults.slow = None
        if report:
            yield report

    # -- one step ------------------------------------------------------------------------
    def _passes(self, sizes: tuple[int, ...] | None) -> int:
        """The most micro-batches any rank has in this step (``Strategy.equal_passes``)."""
        config, world = self.replica.config, self.replica.group.world_size
        base, extra = divmod(config.global_batch, world)
        largest = max(sizes) if sizes is not None else base + (extra > 0)
        return 1 if config.micro_batch is None else -(-largest // config.micro_batch)

    def _step(self, step: int, indices: np.ndarray, batches: Batches | BaseException | None,
              sizes: tuple[int, ...] | None = None) -> StepResult:
        replica, strategy = self.replica, self.replica.strategy
        group = replica.group
        result = StepResult(step=step, rank=group.rank, generation=group.generation, committed=False)
        if not replica.model.training:
            replica.model.train()
        strategy.zero_grad()
        self.buffers.save()  # the forward changes them before the vote is known
        strategy.reduction.begin(step)
        strategy.reduction.save()  # and the reduction's state (if it keeps one), before the vote too
        if replica.batch_stats is not None:
            replica.batch_stats.begin_step()
        self._share = len(indices) / replica.config.global_batch
        # as the last bucket leaves with the vote: a fault of phase allreduce fires, and a
        # request to end the window heard by then (during this step too) goes with the vote
        strategy.before_vote(self._before_vote)
        replica.progress.enter("compute")
        strategy.take_parameter_wait_s()  # not this step's: an evaluation's or a weights file's gathers
        t0 = time.perf_counter()
        local_error: BaseException | None = None
        try:
            if isinstance(batches, BaseException):
                raise batches
            replica.forward_backward(batches if batches is not None else replica.collate(indices), result,
                                     passes=self._passes(sizes) if strategy.equal_passes else 0)
        except Exception as exc:  # recorded; the vote below tells every rank
            local_error = exc
        if replica.batch_stats is not None:  # the collectives of a forward that failed, or of none
            try:
                replica.batch_stats.complete_step()
            except Exception as exc:
                local_error = local_error or exc
        t1 = time.perf_counter()
        parameter_wait = strategy.take_parameter_wait_s()
        replica.progress.enter("reduce")
        vote = self._reduce_and_vote(step, result, local_error)
        if vote is None:
            self._undo()
            return result  # the group failed: result.error says how
        result.stop = vote.stop
        t2 = time.perf_counter()
        replica.progress.enter("update")
        if local_error is not None or not vote.commits:
            result.error = portable(local_error, result.rank, step) if local_error else None
            strategy.zero_grad()
            self._undo()
            return result
        try:
            if not vote.updates:  # a loss or gradient is not finite somewhere: every rank skips the update
                result.nonfinite = True
                strategy.zero_grad()
                self._undo()
                strategy.skip_update(step)
            else:
                if vote.payload is not None:
                    self.buffers.agree(vote.payload)
                self._update(step, result)
            t3 = time.perf_counter()
            strategy.after_commit(step + 1)
        except CollectiveError as exc:  # ZeRO-2's norm, the parameter gather or the snapshot: a peer
            # was lost after the vote; whether this chunk was updated, chunk_holdings tells
            result.error = exc
            return result
        t4 = time.perf_counter()
        result.committed = True
        if self._measured_generation != group.generation:  # its first commit: optimizer state and snapshots exist
            self._measured_generation, self._state_bytes = group.generation, strategy.state_bytes()
        result.state_bytes = self._state_bytes  # with every commit: a step's results can be lost with a peer
        result.timings = {"compute_s": t1 - t0 - parameter_wait, "reduce_wait_s": t2 - t1, "optimizer_s": t3 - t2,
                          "snapshot_s": t4 - t3}
        if replica.config.stage.sharded:  # the forward's wait for the parameters' all-gathers
            result.timings["parameter_wait_s"] = parameter_wait
        return result

    def _undo(self) -> None:
        """The step leaves no trace in the state beside the parameters: the model's buffers
        and the reduction's state go back to what they were before it."""
        self.buffers.restore()
        self.replica.strategy.reduction.restore()

    def _before_vote(self) -> None:
        ballot = self.replica.strategy.ballot
        if self.agree_buffers:  # the last forward has run: the buffers are this step's
            ballot.payload = self.buffers.payload(self._share)
        self.replica.faults.at("allreduce")
        if self.grants.stopping():  # asked to end the window: the vote tells every rank
            ballot.stop()

    def _reduce_and_vote(self, step: int, result: StepResult, local_error: BaseException | None) -> Vote | None:
        """Complete the gradient reduction, which carries the commit vote. None when the
        group failed."""
        strategy = self.replica.strategy
        try:
            if local_error is not None:
                strategy.after_local_error()  # the peers hear of it in the vote (or the group is aborted)
            return strategy.reduce_gradients()
        except Exception as exc:  # the group itself failed: no vote is possible
            strategy.abandon()
            result.error = local_error and portable(local_error, result.rank, step)
            result.error = result.error or CollectiveError(
                f"gen {result.generation} rank {result.rank} step {step}: collective failed: {peer_error(exc)}",
                rank=result.rank, step=step)
            return None

    def _update(self, step: int, result: StepResult) -> None:
        """Apply the committed step's update: clip, learning rate, optimizer."""
        replica, strategy = self.replica, self.replica.strategy
        if replica.config.clip_grad_norm is not None:
            result.grad_norm = strategy.clip_grad_norm(replica.config.clip_grad_norm)
        replica.faults.at("optimizer")
        for group, lr in zip(strategy.param_groups, replica.rates.at(step)):
            group["lr"] = lr
        result.lr = strategy.param_groups[0]["lr"]
        strategy.optimizer_step(step)
