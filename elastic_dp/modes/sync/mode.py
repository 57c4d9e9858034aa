"""Synchronous data parallelism: every member trains a slice of each step's global batch.

For step ``s`` the mode takes the sampler's global batch, splits it into contiguous
slices over the current ranks, and the step counts when every member reports it
committed (docs/design.md: fixed global batch, atomic steps). A member lost in a step raises ``MembersLost``; once
the coordinator has decided who continues, the layout (``.layouts``) carries the state
over to the next generation and says which step comes next (exactly-once). The mode
never touches a tensor: state moves between workers, checkpoints and the output as
opaque objects.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any, Callable, Iterator

import numpy as np

from elastic_dp.data import ElasticSampler, split
from elastic_dp.durable.checkpoint import Checkpoint, CheckpointStore
from elastic_dp.errors import TaskError
from elastic_dp.messages import StepResult
from elastic_dp.modes.base import Failure, MembersLost, Recovery, RecoveryResult
from elastic_dp.modes.calls import Calls
from elastic_dp.modes.context import (
    ModeContext,
    check_resume,
    dataset_length,
    record_resume,
    write_weights,
)
from elastic_dp.modes.saving import SaveOutcome, Saves
from elastic_dp.modes.sync.balance import Balancer
from elastic_dp.modes.sync.generations import Generations
from elastic_dp.modes.sync.layouts import make_layout
from elastic_dp.modes.sync.window import Committed, Window
from elastic_dp.modes.watchdog import HangBounds
from elastic_dp.observe.metrics import known_peak_tflops

logger = logging.getLogger(__name__)

class SyncMode:
    """Synchronous SGD over one collective group per generation (``TrainingMode``)."""

    def __init__(self, context: ModeContext) -> None:
        train, cluster = context.train, context.cluster
        self.train, self.recorder, self.faults = train, context.recorder, context.faults
        bounds = HangBounds(heartbeat_timeout_s=cluster.heartbeat_timeout_s, stall_floor_s=cluster.stall_floor_s,
                            stall_factor=cluster.stall_factor)
        self.gens = Generations(Calls(deadline_s=cluster.step_timeout_s, grace_s=cluster.abort_grace_s,
                                      bounds=bounds), context.faults.link_delay_s)
        self._step_times: deque[float] = deque(maxlen=50)  # the last committed steps, for the hang bound
        self.layout = make_layout(train.stage, self.gens, self._sampler_state)
        self.guard = context.guard()
        self.sampler: ElasticSampler | None = None
        self._last: dict[Any, StepResult] = {}  # the results of the last failed attempt
        self._measured: set[int] = set()  # the generations whose state_memory event is written
        self._windows = 0
        # DiLoCoMode reuses this driver, and its settings have no --balance
        self.balancer = Balancer(train.global_batch) if getattr(train.mode, "balance", False) else None
        self._sizes: tuple[int, ...] | None = None  # the last slicing recorded ...
        self._sized: list[Any] = []  # ... and the members it was for
        self.saves: Saves | None = None
        self.asynchronous_saves = context.checkpoint.asynchronous
        self.settings = context.settings

    @property
    def generation(self) -> int:
        return self.gens.generation

    @property
    def members(self) -> list[Any]:
        return self.gens.members

    # -- start and end -------------------------------------------------------------------
    def start(self, members: list[Any], resume: Checkpoint | None) -> int:
        members = self.layout.rank_order(members)
        self._make_sampler(members)
        if self.recorder.throughput.peak_flops is None:  # no --peak-tflops: a known GPU's
            peak = known_peak_tflops(members[0].info.device_name)
            self.recorder.throughput.peak_flops = peak * 1e12 if peak else None
        check_resume(resume, self.train, self.sampler.dataset_len)
        logger.info("%d workers; model has %d parameters; dataset has %d samples, %d steps per epoch",
                    len(members), members[0].info.num_params, self.sampler.dataset_len,
                    self.sampler.steps_per_epoch)
        if members[0].info.batch_norm and not self.train.global_batch_stats:
            names = members[0].info.batch_norm
            logger.warning("--batch-stats local: the batch-norm modules %s normalise over each worker's slice, so "
                           "the run depends on the worker count; --batch-stats global normalises over the global "
                           "batch", ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
        start = time.perf_counter()
        self.gens.form(members)
        form_s = time.perf_counter() - start
        if resume is not None:  # read and verified by the workers before anything is written
            self.layout.load(resume)
        self.recorder.event("group_formed", generation=self.generation, world_size=len(members),
                            form_s=round(form_s, 4))
        record_resume(self.recorder, resume, len(members))
        if resume is None:
            self.gens.call_all("broadcast_state", 0)
            self.layout.started(0)
        self._write_weights("initial")
        return resume.step if resume is not None else 0

    def _make_sampler(self, members: list[Any]) -> None:
        self.sampler = ElasticSampler(dataset_length(members), global_batch=self.train.global_batch,
                                      seed=self.train.seed)

    def _sampler_state(self) -> dict[str, int]:
        return {"seed": self.sampler.seed, "global_batch": self.sampler.global_batch,
                "dataset_len": self.sampler.dataset_len}

    def _from_rank0(self, method: str, *args: Any) -> Any:
        rank0 = self.members[0]  # its loss is a failure of the whole group (the others survive)
        return self.gens.run(self.members, {getattr(rank0.actor, method).remote(*args): rank0})[rank0]

    def _whole_model(self, method: str, *args: Any) -> Any:
        """Rank 0's result of ``method``, which needs the whole model: at ZeRO stage 3 a
        collective that gathers it unit by unit, so every member makes the call."""
        if not self.train.stage.shards_parameters:
            return self._from_rank0(method, *args)
        return self.gens.call_all(method, *args)[self.members[0]]

    def _write_weights(self, name: str) -> None:
        """``<out>/<name>.safetensors``: written by rank 0 straight to an ``--out`` URI, or
        by this driver into its local ``--out`` directory."""
        write_weights(self.recorder, name, lambda: self._whole_model("model_state"),
                      lambda storage, file: self._whole_model("write_weights", storage, file),
                      self._weight_parts if self.train.stage.shards_parameters else None)

    def _weight_parts(self) -> tuple[list, Iterator[dict]]:
        """ZeRO stage 3: the weights file's layout and its parts (the root and the buffers,
        then each unit), each gathered by the members and sent by rank 0 in turn, so that
        neither rank 0 nor this driver holds more than one of them."""
        layouts = self._whole_model("weight_parts")
        return [t for layout in layouts for t in layout], (self._whole_model("weight_part", i)
                                                           for i in range(len(layouts)))

    def close(self) -> None:
        pass  # the workers are all it has

    def finish(self) -> None:
        self._write_weights("final")
        self.recorder.summary.sample = self._whole_model("sample")

    # -- the step --------------------------------------------------------------------------
    def advance(self, step: int, limit: int | None = None, keep_going: Callable[[], bool] = lambda: True,
                wake: Callable[[], list] = list) -> int:
        """Train from step ``step`` on every member in one window (``.window``): up to
        ``limit`` (default: one step), or to an earlier boundary once ``keep_going()``
        says no (asked again whenever a report or one of ``wake()``'s refs comes in).
        Returns the committed steps afterwards; a failure raises ``MembersLost`` naming
        the step it interrupted."""
        self._windows += 1
        window = Window(self.gens, self.faults, self._sampler_state(), self._windows, step,
                        step + 1 if limit is None else limit, keep_going, wake, self.slice_sizes)
        run = window.run()
        try:
            while True:
                self._committed(next(run))
        except StopIteration as end:
            return end.value
        except MembersLost as lost:
            if lost.step is not None:  # the window's: the survivors' reports of the step it interrupted
                self.layout.stepped(lost.step, lost.reports)
                self._last = lost.reports  # a recovery may find that the step committed
            raise

    def _committed(self, committed: Committed) -> None:
        """A step of the window committed on every member: the layout, the record, the balancer."""
        self.layout.stepped(committed.step, committed.results)
        self._record(committed.step, list(committed.results.values()))
        measured = sorted((r for r in committed.results.values() if r.state_bytes is not None), key=lambda r: r.rank)
        if measured and measured[0].generation not in self._measured and len(measured) == len(committed.results):
            self._measured.add(measured[0].generation)  # the generation's first commit: what each rank holds
            self.recorder.event("state_memory", generation=measured[0].generation, ranks=[
                {"rank": r.rank, "parameters": r.state_bytes["parameters"], "gradients": r.state_bytes["gradients"],
                 "optimizer": r.state_bytes["optimizer_state"], "snapshots": r.state_bytes.get("snapshots", 0)}
                for r in measured])
        if self.balancer is not None and committed.whole:
            self.balancer.observe(committed.results)

    def slice_sizes(self, members: list[Any], step: int) -> tuple[int, ...] | None:
        """The slice sizes of ``members`` (rank order) from ``step`` on (``--balance``;
        None: equal slices); a change is recorded as a ``rebalanced`` event."""
        if self.balancer is None:
            return None
        sizes = self.balancer.sizes(members, self._sizes if members == self._sized else None)
        if sizes is not None and sizes != self._sizes:
            self.recorder.event("rebalanced", step=step, sizes=list(sizes), world_size=len(members))
        self._sizes, self._sized = sizes, list(members)
        return sizes

    def _record(self, step: int, results: list[StepResult]) -> None:
        seconds = max((r.step_s for r in results if r.step_s is not None), default=0.0)
        samples = sum(r.samples for r in results)
        skipped = any(r.nonfinite for r in results)
        loss = None if skipped or not samples else sum(r.loss_sum for r in results) / samples
        # no result: the state the survivors hold shows the step committed, but no report of it came back
        first = results[0] if results else StepResult(step=step, rank=0, generation=self.generation, committed=True)
        timings = {k: round(max(r.timings.get(k, 0.0) for r in results), 6) for k in first.timings}
        if first.timings:  # the rest of the step: waiting for its batch or a grant, reporting
            timings["other_s"] = round(max(0.0, seconds - max(sum(r.timings.values()) for r in results)), 6)
        # every sample of the step was trained (the gradients of a rank lost after the vote
        # were in the all-reduce), even when fewer results came back
        self.recorder.step(step=step, loss=loss, samples=self.train.global_batch, step_s=seconds,
                           world_size=len(self.members), generation=self.generation, timings=timings,
                           nonfinite=skipped, lr=first.lr, grad_norm=first.grad_norm,
                           at=max((r.time for r in results if r.time is not None), default=None))
        if results:
            self._step_times.append(seconds)
            self.gens.calls.typical_step_s = statistics.median(self._step_times)
        self.guard.check(step, results)

    # -- membership changes ----------------------------------------------------------------
    def resize(self, members: list[Any]) -> None:
        self.layout.resize(self.layout.rank_order(members))

    def reform(self, members: list[Any], failure: Failure) -> RecoveryResult:
        members = self.layout.rank_order(members)
        faults = self.faults.take_reform(failure.step, len(members)) if failure.in_flight else {}
        try:
            result = self.layout.reform(members, failure, faults)
        except MembersLost as lost:
            self.faults.put_back(f for rank, f in faults.items() if members[rank] not in lost.lost)
            raise
        self.faults.put_back(faults.values())  # none fired: every rank joined
        if result.outcome is Recovery.COMMITTED and failure.in_flight:
            results = [r for r in self._last.values() if r.committed] or [r for r in self._last.values()
                                                                           if r.samples]
            self._record(failure.step, results)
        return result

    def restore(self, members: list[Any], checkpoint: Checkpoint) -> None:
        self.layout.restore(self.layout.rank_order(members), checkpoint)

    def evaluate(self, step: int) -> tuple[float, int]:
        """Each member evaluates its contiguous share of the eval samples; the loss is the
        sum of their sample-weighted sums over the samples (exact whatever the split)."""
        members = self.gens.members
        total = self._eval_samples(members)
        shares = split(np.arange(total), len(members))
        faults = self.faults.take_eval(step - 1, len(members))
        micro = self.train.micro_batch or self.train.global_batch
        passes = max(-(-len(s) // micro) for s in shares) if self.train.stage.shards_parameters else 0  # forwards are collectives
        calls = {m.actor.evaluate.remote(int(shares[r][0]), int(shares[r][-1]) + 1, faults.get(r), passes): m
                 for r, m in enumerate(members)}
        try:
            reports = self.gens.run(members, calls)
        except MembersLost as lost:  # a survivor's fault did not fire: pending again, for the re-run
            self.faults.put_back(f for r, f in faults.items() if members[r] not in lost.lost)
            raise
        loss_sum = sum(loss for loss, _ in reports.values())
        samples = sum(n for _, n in reports.values())
        return loss_sum / samples, samples

    def _eval_samples(self, members: list[Any]) -> int:
        """How many eval samples an evaluation covers (``--eval-batches`` global batches, or all)."""
        length = members[0].info.eval_len
        if not length:
            raise TaskError("--eval-every evaluates Task.eval_dataset, and the dataset it built is empty")
        batches = self.train.eval_batches
        return length if batches is None else min(length, batches * self.train.global_batch)

    def save(self, store: CheckpointStore, step: int) -> None:
        """Start a checkpoint of the state after ``step`` committed steps: every rank
        writes its own part (``..saving``); ``settle_saves`` reports when it is committed."""
        if self.saves is None:
            self.saves = Saves(store, self.gens.calls, asynchronous=self.asynchronous_saves,
                               settings=self.settings)
        members = self.members
        faults = self.faults.take_checkpoint(step - 1, len(members))
        try:
            self.saves.start(members, self.generation, step, self._sampler_state(), faults)
        except MembersLost as lost:
            self.faults.put_back(f for rank, f in faults.items() if members[rank] not in lost.lost)
            raise
        # every rank came back from its copy: a fault of that phase did not fire (one of
        # phase upload fires, if at all, in the background upload: it is not handed out again)
        self.faults.put_back(f for f in faults.values() if f.phase == "checkpoint")

    def settle_saves(self, wait: bool = False) -> list[SaveOutcome]:
        """The saves that ended (committed or abandoned) since the last call; ``wait``:
        first wait for the one in flight."""
        return self.saves.poll(wait) if self.saves is not None else []
