"""``WorkerActor``: the Ray actor around a ``Replica`` and the program of its mode.

It is a threaded actor (``max_concurrency=3``): one thread runs the step (or another
long call), the others stay free for control calls — heartbeats, and the elastic layer's
abort — while the step is blocked in a collective. The configuration chooses the mode's
program once (``modes.registry.make_program``); the driver reaches it through two entry
points, ``call`` and ``stream``, and a call of another mode's is refused, naming both. The
actor never asks which mode it runs: leaving, aborting, evaluating and checkpoints go
through the program's hooks (``modes.program.Program``). The
coordinator hands a call its faults (``--inject``) with the call; the actor arms them
in the process's ``FaultHook``, and each phase's code fires them.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator

import ray
import torch

from elastic_dp.comm.group import CollectiveGroup, wait_released
from elastic_dp.config import TrainConfig
from elastic_dp.durable.checkpoint import Checkpoint, Part, TrainingState, write_part
from elastic_dp.durable.storage import Storage
from elastic_dp.durable.weights import save_tensor_parts
from elastic_dp.errors import WorkerError
from elastic_dp.faults import SAVE_PHASES, Fault, FaultHook
from elastic_dp.malloc import keep_freed_memory
from elastic_dp.messages import Heartbeat, LeaveNotice, WorkerInfo
from elastic_dp.modes.program import Program
from elastic_dp.modes.registry import make_program, modes_with_call
from elastic_dp.state.base import Resharding
from elastic_dp.state.zero.chunks import ChunkState
from elastic_dp.task import Task
from elastic_dp.worker.leave import SigtermLeave, announce
from elastic_dp.worker.replica import Replica

logger = logging.getLogger(__name__)

RELEASE_WAIT_S = 10.0
"""How long ``reset`` waits for the run's groups to be released (``comm.group.wait_released``)."""


class WorkerActor:
    """One model replica on one GPU (NCCL; gloo where workers share a GPU) or one CPU slot (gloo)."""

    def __init__(self, *, device: str, backend: str, num_threads: int, collective_timeout_s: float,
                 leave_grace_s: float = 25.0) -> None:
        self._environ, self._modules = dict(os.environ), set(sys.modules)  # what a reset goes back to
        self.num_threads = num_threads
        torch.set_num_threads(num_threads)
        keep_freed_memory()  # each step reuses the last one's memory (elastic_dp.malloc)
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(self.device)
        self.group = CollectiveGroup(backend=backend, timeout_s=collective_timeout_s)
        self.faults = FaultHook()
        self.replica: Replica | None = None
        self.program: Program | None = None
        self._staged: dict[str, tuple[Part, Fault | None]] = {}
        """Checkpoint parts copied at a step boundary, waiting for their upload."""
        self.sigterm = SigtermLeave(leave_grace_s, self._leaving)
        """SIGTERM (a container runtime's first word) asks the coordinator to let this worker go."""

    def _leaving(self, notice: LeaveNotice) -> None:
        """The leave thread, after a SIGTERM: tell the coordinator (through the GCS) and end
        the window in flight after its step."""
        announce("actor", ray.get_runtime_context().get_actor_id(), notice)
        if self.program is not None:
            self.program.leave()
        logger.warning("%s: leaving at the next step boundary", notice.describe(time.time()))

    def setup(self, task: Task, config: TrainConfig, settings: dict[str, Any] | None = None) -> WorkerInfo:
        """Build the model, dataset and optimizer (errors surface as TaskError/the cause).
        ``settings``: a kept worker's settings for this run (``backend``,
        ``collective_timeout_s``, ``leave_grace_s``; ``elastic_dp.keep_workers``)."""
        if settings is not None:
            self.group = CollectiveGroup(backend=settings["backend"], timeout_s=settings["collective_timeout_s"])
            self.sigterm.grace_s = settings["leave_grace_s"]
        self.replica = Replica(task, config, self.device, self.group, self.faults)
        self.program = make_program(self.replica)
        if self.sigterm.notice is not None:  # signalled while building
            self.program.leave()
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        return dataclasses.replace(self.replica.info(), node_id=ray.get_runtime_context().get_node_id(),
                                   node_ip=ray.util.get_node_ip_address(), pid=os.getpid(), device_name=name)

    def end(self) -> None:
        """Control thread: the driver is about to stop this worker (its run ended): the
        SIGTERM Ray may send first is not a leave notice, and says nothing."""
        self.sigterm.ending = True

    def reset(self) -> int:
        """Drop everything of the run, for the next one (``elastic_dp.keep_workers``): the
        collective group, the model, optimizer, program and their threads, staged checkpoint
        parts, armed faults; the environment variables as the process started with them;
        the job's own modules (imported since the process started, from outside the Python
        installation and elastic_dp), so the next run imports them afresh. Returns the
        threads left alive. A worker sent SIGTERM is refused (it is leaving)."""
        if self.sigterm.notice is not None:
            raise WorkerError(f"{self.sigterm.notice.cause}: the worker is leaving, it is not kept")
        self.group.abort()
        self.group.destroy()
        wait_released(RELEASE_WAIT_S)  # aborted first: its sockets close and threads end in ms
        self.group = CollectiveGroup(backend=self.group.backend, timeout_s=self.group.timeout_s)
        self.replica = self.program = None
        self._staged.clear()
        self.faults = FaultHook()
        os.environ.clear()
        os.environ.update(self._environ)
        for name in set(sys.modules) - self._modules:
            if _a_job_module(sys.modules.get(name)):
                del sys.modules[name]
        torch.set_num_threads(self.num_threads)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return threading.active_count()

    def configure_group(self, host: str, port: int, generation: int, rank: int, world_size: int,
                        fault: Fault | None = None, link_delay_s: float = 0.0,
                        hosts: tuple[str, ...] | None = None) -> None:
        """Join ``generation`` as ``rank`` (``fault``: phase ``reform``, fired first;
        ``link_delay_s``: ``--inject slowlink``'s least time of each collective; ``hosts``:
        the Ray node of every rank, the generation's mesh)."""
        self.group.delay_s = link_delay_s
        self.faults.arm(fault)
        self.faults.at("reform")
        # what is still in flight on the old group ends now: its waits raise and its teardown (on a
        # thread of its own, CollectiveGroup.destroy) finishes (seen: a survivor's reduction thread
        # blocked on a shard reduce-scatter its peer, already waiting to join the next generation,
        # never issued)
        if self.group.configured:
            self.group.abort(self.group.generation)
        if self.replica is not None:
            self.replica.strategy.drop_pending()
        self.group.configure(host, port, generation=generation, rank=rank, world_size=world_size, hosts=hosts)

    def broadcast_state(self, src: int) -> None:
        self.replica.broadcast_state(src)

    def _call(self, name: str, stream: bool) -> Callable[..., Any]:
        program = self.program
        if program is None:
            raise WorkerError(f"{name} is a call of a training mode's program, and this worker has none yet (setup)")
        if name in (program.streams if stream else program.calls):
            return getattr(program, name)
        mode = self.replica.config.mode.name
        if name in program.calls | program.streams:
            entry, other = ("stream", "call") if stream else ("call", "stream")
            raise WorkerError(f"{name} of --mode {mode} is a {other}, asked for as a {entry}")
        modes = modes_with_call(name)
        if not modes:
            raise WorkerError(f"no training mode's program has a call {name}")
        raise WorkerError(f"{name} is a call of " + " or ".join(f"--mode {m}" for m in modes) +
                          f", and this worker runs --mode {mode}")

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The call ``name`` of this worker's program (its mode's: ``Program.calls``); a call
        of another mode is refused, naming both."""
        return self._call(name, stream=False)(*args, **kwargs)

    @ray.method(num_returns="streaming")
    def stream(self, name: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """The stream ``name`` of this worker's program (``Program.streams``): its items, one
        Ray object each, as they come."""
        yield from self._call(name, stream=True)(*args, **kwargs)

    def evaluate(self, start: int, stop: int, fault: Fault | None = None, passes: int = 0) -> tuple[float, int]:
        """The summed eval loss of samples ``start .. stop`` and their count (``Replica.evaluate``;
        ``fault``: phase ``eval``; ``passes``: at least this many forwards)."""
        self.faults.arm(fault)
        self.replica.progress.enter("eval")
        try:
            with self.program.evaluating():  # e.g. --mode diloco evaluates θ, not a member's own parameters
                return self.replica.evaluate(start, stop, passes)
        finally:
            self.faults.disarm()
            self.replica.progress.enter("idle")

    def heartbeat(self) -> Heartbeat:
        """Control thread: this worker answers, and how far its training thread has come."""
        return self.replica.progress.beat() if self.replica is not None else Heartbeat(0, "idle", 0.0, 0.0)

    def abort_group(self, generation: int | None = None) -> None:
        """Control thread: release a call blocked in a collective or in the rendezvous of
        ``generation`` (default: the current one); an abort of an older one does nothing."""
        if self.program is not None and (generation is None or generation == self.group.generation):
            self.program.abort()  # a window waiting for a grant ends
        self.group.abort(generation)

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.replica.model_state()

    def write_weights(self, storage: Storage, name: str) -> None:
        """Write the model's state dict as the safetensors file ``name`` of ``storage``, a
        part at a time (at ZeRO stage 3 every rank takes part in gathering each unit; rank 0
        writes them)."""
        strategy = self.replica.strategy
        specs = strategy.weight_parts()
        parts = (strategy.weight_part(i) for i in range(len(specs)))
        try:
            if self.group.rank == 0:
                save_tensor_parts(storage, name, [t for part in specs for t in part], parts)
        finally:
            for _ in parts:  # the peers' gathers go on to the last part, whatever the write did
                pass

    def weight_parts(self) -> list:
        return self.replica.strategy.weight_parts()

    def weight_part(self, i: int) -> dict[str, torch.Tensor]:
        """Part ``i`` of the weights, from rank 0 (the others take part in gathering it)."""
        part = self.replica.strategy.weight_part(i)
        return part if self.group.rank == 0 else {}

    # -- checkpoints: every rank writes its own part (the program's: Program.checkpoint_part) --
    def stage_checkpoint(self, directory: str, step: int, sampler: dict[str, int],
                         fault: Fault | None = None) -> int:
        """Training thread, between steps: copy this rank's share of the checkpoint into
        host memory (all a save stalls training for); ``upload_checkpoint`` writes it."""
        self.faults.arm(fault)
        self.faults.at("checkpoint")
        self.faults.disarm(SAVE_PHASES)  # one of phase upload is armed again as its part is written
        part = self.program.checkpoint_part(step, sampler)
        self._staged[directory] = part, fault
        return sum(t.numel() * t.element_size() for f in part.files.values() for t in f.values())

    @ray.method(concurrency_group="io")
    def upload_checkpoint(self, storage: Storage, directory: str) -> dict:
        """I/O thread, while training goes on: write the staged part into ``directory`` of
        ``storage``; the manifest's entries for it (sizes, sha256, pieces)."""
        part, fault = self._staged.pop(directory)
        self.faults.arm(fault)  # staged with its part: it fires as this part is written
        self.faults.at("upload")
        return write_part(storage, directory, part)

    def write_checkpoint(self, storage: Storage, directory: str, step: int, sampler: dict[str, int],
                         fault: Fault | None = None) -> dict:
        """Both at once, on the training thread (``--sync-checkpoints``)."""
        self.stage_checkpoint(directory, step, sampler, fault)
        return write_part(storage, directory, self._staged.pop(directory)[0])

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Read this rank's needs of ``checkpoint`` from its storage and load them (with ZeRO
        a collective)."""
        self.program.load_checkpoint(checkpoint)

    def training_state(self, step: int, sampler: dict[str, int]) -> TrainingState:
        return self.replica.training_state(step, sampler)

    @ray.method(num_returns=2)
    def share_state(self, step: int, sampler: dict[str, int]) -> tuple[int, TrainingState]:
        """This worker's whole state for other workers, as two objects: a small one the
        coordinator waits for (is the source alive?) and the state, which goes from the
        object store to the workers that load it without passing through the coordinator."""
        return step, self.replica.training_state(step, sampler)

    def load_state(self, state: TrainingState) -> None:
        self.replica.load_state(state)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this worker holds now."""
        return self.replica.strategy.state_bytes()

    # -- ZeRO: peer snapshots and resharding --------------------------------------------------
    def _resharding(self, call: str) -> Resharding:
        strategy = self.replica.strategy
        if not hasattr(strategy, "import_chunks"):
            raise WorkerError(f"{call} moves ZeRO chunks, and this worker's state is replicated (--zero 0)")
        return strategy

    def chunk_holdings(self) -> dict:
        return self._resharding("chunk_holdings").holdings()

    @ray.method(num_returns=2)
    def export_chunk(self, kind: str, step: int) -> tuple[int, ChunkState]:
        """A chunk (``share_state``'s two objects): the coordinator waits for the first."""
        return step, self._resharding("export_chunk").export(kind, step)

    def import_chunks(self, refs: list, old_world_size: int, step: int) -> int:
        """Collective over the new generation: take this rank's chunk (and a snapshot of its
        left neighbour's) out of the old generation's chunks ``refs`` (in old chunk order),
        those it does not hold itself; returns how many it fetched."""
        return self._resharding("import_chunks").import_chunks(lambda needed: ray.get([refs[i] for i in needed]),
                                                               old_world_size, step)  # fetched in parallel

    def sample(self) -> str | None:
        """The task's sample of what the model does now (None when the task has none)."""
        task = self.replica.task
        if task.sample is None:
            return None
        if not self.replica.config.stage.shards_parameters:
            return task.sample(self.replica.settled_model())
        with torch.random.fork_rng():  # every rank runs the same forwards, which gather the units
            torch.manual_seed(self.replica.config.seed)
            return task.sample(self.replica.settled_model())


def _a_job_module(module: Any) -> bool:
    """A module of the job's own code: from a file outside the Python installation (the
    standard library, site-packages) and not elastic_dp's."""
    path = getattr(module, "__file__", None)
    name = getattr(module, "__name__", "")
    if not path or name == "elastic_dp" or name.startswith("elastic_dp."):
        return False
    installed = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return not any(os.path.realpath(path).startswith(os.path.realpath(p) + os.sep) for p in installed)


def remote_worker_class():
    """The Ray actor class (created lazily so importing elastic_dp does not need Ray up)."""
    return ray.remote(max_concurrency=3, concurrency_groups={"io": 1})(WorkerActor)
