"""The settings of ``--mode sync``: how a step's batch is split, the ZeRO stage, the buckets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from elastic_dp.comm.settings import Buckets
from elastic_dp.errors import ConfigError
from elastic_dp.modes.settings import ModeSettings
from elastic_dp.settings import OMIT, choice, part, setting
from elastic_dp.state.zero.settings import STAGES


@dataclass(kw_only=True, slots=True, frozen=True)
class SyncSettings(ModeSettings):
    """Synchronous data parallelism: every worker trains a slice of each step."""

    name = "sync"
    driver = "elastic_dp.modes.sync.mode:SyncMode"
    program = "elastic_dp.modes.sync.program:SyncProgram"
    reduces_gradients = True
    steps_task_optimizer = True
    zero: Any = choice(STAGES, 0, "--zero", kind=int, help=(
        "ZeRO stage: 0 replicates everything; 1 shards the optimizer state (and the fp32 masters of bf16 "
        "parameters); 2 also the gradients, reduce-scattered in buckets during backward; 3 also the parameters, "
        "gathered unit by unit for the forward and again for the backward (docs/zero.md); needs an element-wise "
        "optimizer"))
    buckets: Buckets = part(Buckets)
    balance: bool = setting(False, "--balance", help=(
        "split each step's global batch in proportion to the workers' measured speed, so that a straggler gets "
        "fewer samples; the parameters are the same as with equal slices (docs/sync.md)"))
    prefetch: bool | None = setting(None, "--prefetch", off="--no-prefetch", help=(
        "collate the next step's batch on a background thread, into pinned memory (default: on a GPU, where the "
        "copy overlaps; not on a CPU, where the two threads contend for Python's GIL)"))
    batch_stats: Literal["local", "global"] = setting(
        "local", "--batch-stats", choices=("local", "global"),
        identity=lambda value, train: OMIT if value == "local" else value, help=(
            "batch-norm statistics in training: local (default, as DDP) over each worker's slice, so that the run "
            "depends on the worker count; global over the step's global batch across the members (SyncBatchNorm's "
            "semantics, on gloo and NCCL), so that the run equals the one-process replay at any worker count"))

    def check(self, train: Any) -> None:
        """What this mode's settings need of the run's core."""
        if self.buckets.all_reduce is not None and self.zero.number != 0:
            raise ConfigError(f"--all-reduce {self.buckets.all_reduce} chooses ZeRO stage 0's all-reduce; stage "
                              f"{self.zero.number} reduce-scatters its gradients: drop --all-reduce")
        compress = self.buckets.compress
        if compress is not None and self.zero.number == 3:
            raise ConfigError(f"--compress {compress} keeps each rank's error of the whole gradient, which ZeRO stage 3 "
                              "never holds (each unit's gradient is reduce-scattered and freed as its backward ends): "
                              "train at --zero 0, 1 or 2, or drop --compress")
        if compress is not None and self.zero.number in (1, 2):
            if self.zero.shard_scope != "all":
                raise ConfigError(f"--compress {compress} at ZeRO stage {self.zero.number} reduce-scatters over every "
                                  f"rank, and --shard-scope {self.zero.shard_scope} cuts the state inside each host: "
                                  "drop one of them")
            if self.buckets.compress_scope != "all":
                raise ConfigError(f"--compress-scope {self.buckets.compress_scope} compresses the hop between the "
                                  f"hosts of ZeRO stage 0's hierarchical all-reduce; stage {self.zero.number} "
                                  "reduce-scatters: drop --compress-scope, or train at --zero 0")
            if self.zero.snapshot_every != 1:
                raise ConfigError(f"--compress {compress} at ZeRO stage {self.zero.number} keeps the error feedback "
                                  "of the step under way and the one before it, and a failure restores the chunks "
                                  f"of up to --snapshot-every {self.zero.snapshot_every} steps back: use "
                                  "--snapshot-every 1 with --compress")
        if self.buckets.compress is not None and self.buckets.all_reduce == "hierarchical" and \
                self.buckets.compress_scope != "hosts":
            raise ConfigError(f"--compress {self.buckets.compress} replaces the all-reduce with its own flat "
                              "collectives, and --all-reduce hierarchical asks for the hosts' one: drop one of them, "
                              "or compress only the hop between the hosts (--compress int8 --compress-scope hosts)")

    def check_run(self, train: Any, cluster: Any, checkpoint: Any) -> None:
        """``--batch-stats global`` makes one forward per worker and step: a ``--micro-batch``
        is refused only where it would split a slice, at the fewest workers the run trains
        with (with ``--balance`` a slice may grow to all the batch but a sample a peer)."""
        if self.batch_stats != "global" or train.micro_batch is None:
            return
        fewest = cluster.min_workers
        largest = train.global_batch - (fewest - 1) if self.balance else -(-train.global_batch // fewest)
        if train.micro_batch < largest:
            at = f"at {fewest} worker{'s' * (fewest > 1)} (MIN of --workers MIN:MAX)"
            raise ConfigError(
                f"--batch-stats global computes batch-norm statistics over the global batch in one forward per "
                f"worker, and --micro-batch {train.micro_batch} would split a slice: {at} a worker's slice of the "
                f"global batch {train.global_batch} is up to {largest} samples"
                f"{' (with --balance)' if self.balance else ''}: raise --micro-batch to {largest}, drop it, or use "
                "--batch-stats local")
