"""Peer implementations the benchmarks compare against, as Ray actors.

Plain classes in an importable module, made actors with ``remote(cls)``: Ray then
pickles them by reference (a class defined in ``__main__``, or decorated in place, is
pickled by value, which fails for these).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import numpy as np
import ray
import torch
import torch.distributed as dist

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reducer import GradientReducer
from elastic_dp.data import ElasticSampler, micro_batches, split
from elastic_dp.malloc import keep_freed_memory
from jobs.gpt import TASK


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[None]:
    """A local Ray cluster of this benchmark's own (own temp dir), shut down and removed after."""
    temp_dir = tempfile.mkdtemp(prefix="edp-bench-", dir="/tmp")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


class DDPWorker:
    """torch DDP on one CPU slot: the peer a user would otherwise pick, run the way its
    users run it (torchrun-style): ``run`` loops over its own steps, its rank's slice of
    each computed here, with no driver in between; the benchmark calls it once per round.
    With ``zero`` its optimizer is torch's ZeroRedundancyOptimizer (optimizer-state
    sharding, ZeRO stage 1). Its process keeps freed memory as elastic_dp's workers do
    (elastic_dp.malloc; ``keep_memory``), so the benchmarks compare the trainers, not the
    allocators' settings (docs/BENCHMARKS.md)."""

    def __init__(self, host: str, port: int, rank: int, world: int, zero: bool = False, task=TASK,
                 keep_memory: bool = True) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.set_num_threads(1)
        if keep_memory:
            keep_freed_memory()
        store = dist.PrefixStore("zero/" if zero else "ddp/", dist.TCPStore(host, port, is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        self.task, self.rank, self.world = task, rank, world
        torch.manual_seed(task.defaults.seed)
        self.model = task.model()
        self.ddp = DDP(self.model, bucket_cap_mb=task.defaults.buckets.bucket_mb)
        self.dataset = task.dataset()
        self.optimizer = task.optimizer(self.model)
        if zero:
            settings = {k: self.optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
            self.optimizer = ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=type(self.optimizer),
                                                     **settings)
        self.config = task.defaults
        self.sampler = ElasticSampler(len(self.dataset), global_batch=self.config.global_batch,
                                      seed=self.config.seed)

    def run(self, start: int, steps: int) -> float:
        """Train steps ``start``..``start + steps - 1``; the seconds they took."""
        began = time.perf_counter()
        for step in range(start, start + steps):
            self.step(split(self.sampler.batch(step), self.world)[self.rank], self.config.global_batch)
        return time.perf_counter() - began

    def step(self, indices: np.ndarray, global_batch: int) -> float:
        start = time.perf_counter()
        self.optimizer.zero_grad()
        chunks = micro_batches(indices, self.config.micro_batch)
        for i, chunk in enumerate(chunks):
            batch = self.task.collate([self.dataset[int(j)] for j in chunk])
            scale = len(chunk) * dist.get_world_size() / global_batch  # DDP averages over ranks
            self._backward(batch, scale, last=i == len(chunks) - 1)
        if self.config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
        self.optimizer.step()
        return time.perf_counter() - start

    def _backward(self, batch, scale: float, last: bool) -> None:
        """One micro-batch's backward; the gradients are reduced with the last one's."""
        with contextlib.nullcontext() if last else self.ddp.no_sync():
            (self.task.loss(self.ddp, batch) * scale).backward()


class FSDP2Worker(DDPWorker):
    """torch FSDP2 on one CPU slot, the peer of ZeRO stage 3: the GPT's blocks and then the
    whole model ``fully_shard``-ed, as its users write it (torch's defaults: parameters
    resharded after each forward), each rank looping over its own steps (``run``), its
    rank's slice of each computed here. Micro-batches before a step's last skip the
    gradient reduce-scatter (``set_requires_gradient_sync(False)``), as FSDP2's users
    accumulate."""

    def __init__(self, host: str, port: int, rank: int, world: int, task=TASK, keep_memory: bool = True) -> None:
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        if keep_memory:
            keep_freed_memory()
        store = dist.PrefixStore("fsdp2/", dist.TCPStore(host, port, is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        self.task, self.rank, self.world = task, rank, world
        torch.manual_seed(task.defaults.seed)
        self.model = task.model()
        for block in self.model.blocks:
            fully_shard(block)
        fully_shard(self.model)
        self.ddp = self.model  # the module the loss runs (DDPWorker.step)
        self.dataset = task.dataset()
        self.optimizer = task.optimizer(self.model)
        self.config = task.defaults
        self.sampler = ElasticSampler(len(self.dataset), global_batch=self.config.global_batch,
                                      seed=self.config.seed)

    def _backward(self, batch, scale: float, last: bool) -> None:
        self.model.set_requires_gradient_sync(last)
        (self.task.loss(self.model, batch) * scale).backward()

    def state_bytes(self) -> dict[str, int]:
        """What this rank holds between steps: its shards of the parameters, of the
        gradients (FSDP2 keeps them sharded until the next zero_grad) and of AdamW's state."""
        def local(t: torch.Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        params = list(self.model.parameters())
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"parameters": sum(local(p) for p in params),
                "gradients": sum(local(p.grad) for p in params if p.grad is not None),
                "optimizer_state": sum(local(v) for v in state)}


class ReduceWorker:
    """Times elastic_dp's bucketed reduction against a raw all_reduce on one gloo group."""

    def __init__(self, host: str, port: int, rank: int, world: int, numel: int, bucket_mb: float) -> None:
        torch.set_num_threads(1)
        self.group = CollectiveGroup(backend="gloo", timeout_s=120)
        self.group.configure(host, port, generation=0, rank=rank, world_size=world)
        self.params = [torch.nn.Parameter(torch.randn(numel // 4)) for _ in range(4)]
        self.reducer = GradientReducer(self.params, self.group, bucket_bytes=int(bucket_mb * 2**20),
                                       reduce_fp32=True)
        self.reducer.zero_grad()  # gradients become views into the buckets, as in training
        for p in self.params:
            p.grad.normal_()
        self.flat = torch.randn(sum(p.numel() for p in self.params))

    def time_bucketed(self, iters: int) -> float:
        start = time.perf_counter()
        for _ in range(iters):
            self.reducer.arm()
            self.reducer.finish()
        return (time.perf_counter() - start) / iters

    def time_raw(self, iters: int) -> float:
        start = time.perf_counter()
        for _ in range(iters):
            self.group.all_reduce(self.flat)
        return (time.perf_counter() - start) / iters


class ShardedCollectivesWorker:
    """Times the collectives of ZeRO's sharded stages on one gloo group: gloo's own
    reduce-scatter and all-gather (``_reduce_scatter_base``, ``_allgather_base``) against
    ``CollectiveGroup``'s, which run them as all-to-alls, on a flat buffer of ``numel``."""

    def __init__(self, host: str, port: int, rank: int, world: int, numel: int) -> None:
        torch.set_num_threads(1)
        self.group = CollectiveGroup(backend="gloo", timeout_s=120)
        self.group.configure(host, port, generation=0, rank=rank, world_size=world)
        numel = -(-numel // world) * world
        self.full, self.chunk = torch.randn(numel), torch.empty(numel // world)

    def time(self, op: str, iters: int) -> float:
        """Seconds per call of ``op``: ``reduce_scatter``/``all_gather`` (``CollectiveGroup``)
        or ``gloo_reduce_scatter``/``gloo_all_gather`` (the process group's own)."""
        pg = self.group._pg
        calls = {"reduce_scatter": lambda: self.group.reduce_scatter_async(self.chunk, self.full),
                 "all_gather": lambda: self.group.all_gather_async(self.full, self.chunk),
                 "gloo_reduce_scatter": lambda: pg._reduce_scatter_base(self.chunk, self.full),
                 "gloo_all_gather": lambda: pg._allgather_base(self.full, self.chunk)}
        call = calls[op]
        start = time.perf_counter()
        for _ in range(iters):
            call().wait()
        return (time.perf_counter() - start) / iters


def remote(cls):
    """``cls`` as a Ray actor class holding one CPU slot."""
    return ray.remote(num_cpus=1)(cls)


def ray_train_loop(config: dict) -> None:
    """The GPT job as a Ray Train v2 ``TorchTrainer`` loop: DDP, a checkpoint every
    ``config["every"]`` steps, resume from the latest one after a restart, and one
    SIGKILL of rank 1 at the start of ``config["crash_step"]`` (marker file: once per run).
    Rank 0 logs ``step time world_size`` per committed step to ``config["log"]``."""
    import signal

    def crash(step: int, rank: int) -> None:
        if step == config["crash_step"] and rank == 1 and not os.path.exists(config["marker"]):
            with open(config["marker"], "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    _ray_train_gpt(config, before_step=crash)


def ray_train_preemption_loop(config: dict) -> None:
    """The same job with Ray Train v2's documented preemption handling (2.60,
    ``ray.train.get_preemption_info``'s docstring): every rank asks after each step, and
    at the first notice rank 0 reports a just-in-time checkpoint and training goes on;
    when the node goes (or the deadline passes) the controller restarts the workers from
    the latest checkpoint."""
    import ray.train

    saved = []

    def after_step(step: int, save) -> None:
        if ray.train.get_preemption_info() is not None and not saved:
            save(step)
            saved.append(step)
            with open(config["log"] + ".jit", "a") as f:
                f.write(f"{step} {time.time()}\n")

    _ray_train_gpt(config, after_step=after_step)


def _ray_train_gpt(config: dict, before_step=None, after_step=None) -> None:
    """The body of the Ray Train loops: the GPT job under DDP from the latest checkpoint,
    a checkpoint every ``config["every"]`` steps, ``before_step(step, rank)`` and
    ``after_step(step, save)`` (``save(step)`` reports a checkpoint after ``step``) around
    each step."""
    import tempfile

    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(TASK.defaults.seed)
    model, dataset = TASK.model(), TASK.dataset()
    optimizer = TASK.optimizer(model)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = ray.train.torch.prepare_model(model)
    sampler = ElasticSampler(len(dataset), global_batch=TASK.defaults.global_batch, seed=TASK.defaults.seed)

    def save(step: int) -> None:
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step + 1}, os.path.join(d, "state.pt"))
            ray.train.report({"step": step},
                             checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)

    for step in range(start, config["steps"]):
        if before_step is not None:
            before_step(step, rank)
        indices = split(sampler.batch(step), world)[rank]
        optimizer.zero_grad()
        TASK.loss(ddp, TASK.collate([dataset[int(i)] for i in indices])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TASK.defaults.clip_grad_norm)
        optimizer.step()
        if rank == 0:
            with open(config["log"], "a") as f:
                f.write(f"{step} {time.time()} {world}\n")
        if (step + 1) % config["every"] == 0:
            save(step)
        elif after_step is not None:
            after_step(step, save)


class BlockOnce:
    """A loss that blocks its worker's training thread forever at its ``call``-th call, in
    one worker only (the first to create ``marker``); the process keeps answering. For the
    recovery benchmark's stalled-thread case."""

    def __init__(self, loss, call: int, marker: str) -> None:
        self.loss, self.call, self.marker, self.calls = loss, call, marker, 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == self.call:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass  # another worker blocks
            else:
                threading.Event().wait()
        return self.loss(model, batch)

