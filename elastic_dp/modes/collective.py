"""A run over one collective group per generation: the part of a mode's driver half that
the synchronous mode and DiLoCo share, held by each (composition: neither mode reaches
into the other).

``CollectiveRun`` forms the generations (``sync.generations``), keeps the state's layout
(the stage's: ``sync.layouts.make_layout``), and does what does not depend on how the
steps run: the start (from rank 0's fresh model or a checkpoint), the record of each
committed step, the evaluation split over the members, the checkpoints every rank writes
a part of, and the weights files. How steps are trained, and what a change of members
does to the state, is the mode's own.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any, Iterator

import numpy as np

from elastic_dp.comm.mesh import rank_order
from elastic_dp.data import ElasticSampler, split
from elastic_dp.durable.checkpoint import Checkpoint, CheckpointStore
from elastic_dp.durable.weights import TensorSpecs
from elastic_dp.errors import TaskError
from elastic_dp.messages import StepResult
from elastic_dp.modes.base import MembersLost
from elastic_dp.modes.calls import Calls
from elastic_dp.modes.context import ModeContext
from elastic_dp.modes.saving import SaveOutcome, Saves, write_weights
from elastic_dp.modes.start import check_resume, dataset_length, record_resume
from elastic_dp.modes.sync.generations import Generations
from elastic_dp.modes.sync.layouts import make_layout
from elastic_dp.modes.watchdog import HangBounds
from elastic_dp.observe.metrics import known_peak_tflops

logger = logging.getLogger(__name__)


class CollectiveRun:
    """The generations of a run's collective group and what every step-group mode does with them."""

    def __init__(self, context: ModeContext) -> None:
        train, cluster = context.train, context.cluster
        self.train, self.recorder, self.faults = train, context.recorder, context.faults
        bounds = HangBounds(heartbeat_timeout_s=cluster.heartbeat_timeout_s, stall_floor_s=cluster.stall_floor_s,
                            stall_factor=cluster.stall_factor)
        self.gens = Generations(Calls(deadline_s=cluster.step_timeout_s, grace_s=cluster.abort_grace_s,
                                      bounds=bounds), context.faults.link_delay_s, formed=self._formed)
        self.layout = make_layout(train.stage, self.gens, self.sampler_state,
                                  compressed=train.buckets.compress is not None)
        self.guard = context.guard()
        self.sampler: ElasticSampler | None = None
        self._started = False  # the start's checks passed: events may be written
        self._mesh: dict[str, Any] = {}  # the last generation's mesh event
        self._step_times: deque[float] = deque(maxlen=50)  # the last committed steps, for the hang bound
        self.saves: Saves | None = None
        self.asynchronous_saves = context.checkpoint.asynchronous
        self.settings = context.settings

    @property
    def generation(self) -> int:
        return self.gens.generation

    @property
    def members(self) -> list[Any]:
        return self.gens.members

    def _formed(self, generation: int, members: list[Any]) -> None:
        """The ``mesh`` event: where each rank of a new generation runs (docs/hosts.md); the
        first generation's is held until the start's checks passed (a refused resume writes
        nothing)."""
        self._mesh = {"generation": generation, "hosts": [m.info.node_ip for m in members],
                      "pids": [m.info.pid for m in members]}
        if self._started:
            self.recorder.event("mesh", **self._mesh)

    # -- start and end -------------------------------------------------------------------
    def rank_order(self, members: list[Any], keep_places: bool = False) -> list[Any]:
        """The rank order of a generation over ``members`` (in the membership policy's
        order): each host's members contiguous (``comm.mesh.rank_order``); with
        ``keep_places`` the current generation's members keep their ranks where they can,
        a joiner taking the place of one of its host's ranks that left."""
        return rank_order(members, lambda m: m.info.node_id, self.members if keep_places else ())

    def start(self, members: list[Any], resume: Checkpoint | None) -> int:
        """Form the first generation over ``members`` and give it one state: the checkpoint
        ``resume``'s, or rank 0's fresh model; write the initial weights. Returns the first step."""
        members = self.rank_order(members)
        self.sampler = ElasticSampler(dataset_length(members), global_batch=self.train.global_batch,
                                      seed=self.train.seed)
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
        self._started = True
        self.recorder.event("mesh", **self._mesh)
        self.recorder.event("group_formed", generation=self.generation, world_size=len(members),
                            form_s=round(form_s, 4))
        record_resume(self.recorder, resume, len(members))
        if resume is None:
            self.gens.call_all("broadcast_state", 0)
            self.layout.started(0)
        self.write_weights("initial")
        return resume.step if resume is not None else 0

    def sampler_state(self) -> dict[str, int]:
        """The sampler as a worker rebuilds it (``ElasticSampler``'s arguments)."""
        return {"seed": self.sampler.seed, "global_batch": self.sampler.global_batch,
                "dataset_len": self.sampler.dataset_len}

    def whole_model(self, method: str, *args: Any) -> Any:
        """Rank 0's result of ``method``, which needs the whole model: where no rank holds it
        (``Stage.shards_parameters``) a collective that gathers it unit by unit, so every
        member makes the call."""
        if self.train.stage.shards_parameters:
            return self.gens.call_all(method, *args)[self.members[0]]
        rank0 = self.members[0]  # its loss is a failure of the whole group (the others survive)
        return self.gens.run(self.members, {getattr(rank0.actor, method).remote(*args): rank0})[rank0]

    def write_weights(self, name: str) -> None:
        """``<out>/<name>.safetensors``: written by rank 0 straight to an ``--out`` URI, or
        by this driver into its local ``--out`` directory."""
        write_weights(self.recorder, name, lambda: self.whole_model("model_state"),
                      lambda storage, file: self.whole_model("write_weights", storage, file),
                      self._weight_parts if self.train.stage.shards_parameters else None)

    def _weight_parts(self) -> tuple[TensorSpecs, Iterator[dict]]:
        """Where no rank holds the whole model: the weights file's tensors and its parts (the
        root and the buffers, then each unit), each gathered by the members and sent by rank
        0 in turn, so that neither rank 0 nor this driver holds more than one of them."""
        specs = self.whole_model("weight_parts")
        return [t for part in specs for t in part], (self.whole_model("weight_part", i) for i in range(len(specs)))

    def finish(self) -> None:
        self.write_weights("final")
        self.recorder.summary.sample = self.whole_model("sample")

    # -- the record of a step ------------------------------------------------------------------
    def record(self, step: int, results: list[StepResult]) -> None:
        """Committed step ``step``, from its members' results: metrics, the hang bound's step
        time, the non-finite guard."""
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

    # -- evaluation, checkpoints -----------------------------------------------------------------
    def restore(self, members: list[Any], checkpoint: Checkpoint) -> None:
        """A new generation over ``members`` (in the layout's rank order) loads ``checkpoint``."""
        self.layout.restore(self.rank_order(members), checkpoint)

    def evaluate(self, step: int) -> tuple[float, int]:
        """Each member evaluates its contiguous share of the eval samples; the loss is the
        sum of their sample-weighted sums over the samples (exact whatever the split)."""
        members = self.gens.members
        total = self._eval_samples(members)
        shares = split(np.arange(total), len(members))
        faults = self.faults.take_eval(step - 1, len(members))
        micro = self.train.micro_batch or self.train.global_batch
        # where a forward is a collective, every member runs as many
        passes = max(-(-len(s) // micro) for s in shares) if self.train.stage.shards_parameters else 0
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
        writes its own part (``.saving``); ``settle_saves`` reports when it is committed."""
        if self.saves is None:
            self.saves = Saves(store, self.gens.calls, asynchronous=self.asynchronous_saves,
                               settings=self.settings)
        members = self.members
        faults = self.faults.take_checkpoint(step - 1, len(members))
        try:
            self.saves.start(members, self.generation, step, self.sampler_state(), faults)
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


class OnCollectiveRun:
    """The part of ``TrainingMode`` that a mode over a ``CollectiveRun`` (its ``run``)
    answers as the run does: the generation and its members, the start, evaluation, saves,
    a restart from a checkpoint and the end. The sync mode and DiLoCo are built on it and
    add how steps are trained and what a change of members does (a mode overrides what it
    does otherwise: DiLoCo's start)."""

    run: CollectiveRun

    @property
    def generation(self) -> int:
        return self.run.generation

    @property
    def members(self) -> list[Any]:
        return self.run.members

    def start(self, members: list[Any], resume: Checkpoint | None) -> int:
        return self.run.start(members, resume)

    def restore(self, members: list[Any], checkpoint: Checkpoint) -> None:
        self.run.restore(members, checkpoint)

    def evaluate(self, step: int) -> tuple[float, int]:
        return self.run.evaluate(step)

    def save(self, store: CheckpointStore, step: int) -> None:
        self.run.save(store, step)

    def settle_saves(self, wait: bool = False) -> list[SaveOutcome]:
        return self.run.settle_saves(wait)

    def finish(self) -> None:
        self.run.finish()

    def close(self) -> None:
        pass  # the workers are all it has

    def standby(self, workers: list[Any]) -> None:
        pass  # DiLoCo keeps no spare in step (the sync mode at stage 0 does: SyncMode.standby)

    def state_copies(self) -> dict[Any, int]:
        return self.run.layout.copies()
