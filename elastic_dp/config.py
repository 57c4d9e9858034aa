"""Configuration: one small dataclass per concern, validated at construction.

Each error names the field and the CLI flag that sets it, so a user knows what to change.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from elastic_dp.errors import ConfigError
from elastic_dp.schedules import SCHEDULES, schedule_factor


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Hyper-parameters of a run. None of them depends on the number of workers."""

    steps: int = 100
    """Optimizer steps to train (``--steps``)."""
    global_batch: int = 32
    """Samples per step, summed over all workers (``--global-batch``). Fixed for the run."""
    micro_batch: int | None = None
    """Most samples one worker puts through one forward/backward (``--micro-batch``);
    a larger slice is split and its gradients accumulated. None: the whole slice at once."""
    seed: int = 0
    """Seeds model initialisation and the sampler's shuffles (``--seed``)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup from 0 over this many steps (``--warmup-steps``)."""
    lr_schedule: Literal["constant", "cosine", "linear", "wsd"] = "constant"
    """After the warmup: ``constant``; ``cosine`` or ``linear`` decay to ``min_lr_ratio`` at
    ``decay_steps``; ``wsd`` (warmup, stable, decay) constant, then a linear decay over the
    last ``decay_fraction`` of ``decay_steps`` (``--lr-schedule``; the rules:
    ``elastic_dp.schedules.schedule_factor``, README)."""
    decay_steps: int | None = None
    """The step at which the decay reaches ``min_lr_ratio`` (``--decay-steps``). None: ``steps``."""
    min_lr_ratio: float = 0.1
    """The decayed rate, as a fraction of the base rate (``--min-lr-ratio``)."""
    decay_fraction: float = 0.1
    """``wsd``: the fraction of ``decay_steps`` that the decay takes (``--decay-fraction``)."""
    eval_every: int | None = None
    """Evaluate ``Task.eval_dataset`` after every this many committed steps, and after the
    last (``--eval-every``). None: no evaluation."""
    eval_batches: int | None = None
    """Evaluate on the first this many global batches of the eval set (``--eval-batches``).
    None: the whole eval set."""
    lr_reference_batch: int | None = None
    """Linear scaling rule: the optimizer's learning rates are multiplied by
    ``global_batch / lr_reference_batch`` (``--lr-reference-batch``). None: no scaling."""
    clip_grad_norm: float | None = None
    """Clip gradients to this global L2 norm before each update (``--clip-grad-norm``)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16`` runs forward/backward under bf16 autocast (``--precision``)."""
    batch_stats: Literal["local", "global"] = "local"
    """Batch-norm statistics in training (``--batch-stats``): ``local`` over each worker's
    slice, as DDP (the trajectory then depends on the worker count, and the run says which
    modules make it so); ``global`` over the step's global batch across the members, as
    SyncBatchNorm, on gloo and NCCL alike (``elastic_dp.comm.batchnorm``), so that the run
    does not depend on the worker count. Either way the replicas agree on the running
    statistics after every step (``elastic_dp.state.buffers``)."""
    reduce_fp32: bool = True
    """Reduce gradients in fp32 even when parameters are bf16 (``--no-reduce-fp32``)."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB; each full bucket is all-reduced while backward goes
    on (``--bucket-mb``). Buckets are also ZeRO's unit of sharding."""
    first_bucket_mb: float | None = None
    """The first bucket (the last layers' gradients, the first that backward produces)
    closes at this many MiB, so that their reduction starts while backward goes on through
    the rest (``--first-bucket-mb``). None: 1 MiB on a GPU (as DDP's default), where the
    collective runs beside the compute; on a CPU, no smaller first bucket: gloo's threads
    take their CPU from the cores the compute needs, and the second collective cost more
    than the overlap gave (docs/sync.md)."""
    zero: int = 0
    """ZeRO stage (``--zero``): 0 replicates everything; 1 shards the optimizer state (and
    the fp32 master weights of bf16/fp16 parameters); 2 also shards the gradients; 3 also
    the parameters, gathered unit by unit for the forward and the backward (docs/zero.md)."""
    reshard_after_forward: bool = True
    """ZeRO stage 3: free each unit's gathered parameters after its forward and gather them
    again for its backward; False (``--no-reshard-after-forward``) keeps them from the
    forward to the backward: one all-gather a unit less per step, for the memory of the
    whole model's parameters at the end of the forward."""
    init: Literal["auto", "whole", "units"] = "auto"
    """How the model's initial parameters are made (``--init``): ``whole`` runs the task's
    model factory as it is, on every worker; ``units`` runs it on the meta device and
    materialises and initialises each shard unit on its own under the unit's seed
    (docs/zero.md, the initialisation rule), so that at ``--zero 3`` no worker ever holds
    the whole model; ``auto``: ``units`` at ``--zero 3``, ``whole`` at the other stages."""
    activation_checkpointing: bool = False
    """Recompute each shard unit's activations in its backward instead of keeping them from
    the forward (``--activation-checkpointing``; the units of ``--zero 3``, at any stage)."""
    snapshot_every: int = 1
    """With ZeRO, every how many committed steps each worker copies its chunk to its
    neighbour's host memory (``--snapshot-every``). A worker lost k steps after the
    last snapshot costs a rollback and replay of those k steps."""
    on_nonfinite: Literal["skip", "fail"] = "skip"
    """A step whose loss or gradient is not finite makes no update on any rank; ``skip``
    goes on with the next step (the skipped one counts as trained, a no-op), ``fail`` ends
    the run naming the step and the rank (``--on-nonfinite``)."""
    max_nonfinite_steps: int = 5
    """With ``skip``: fail after this many consecutive skipped steps (``--max-nonfinite-steps``)."""
    mode: Literal["sync", "async", "diloco"] = "sync"
    """``sync``: every worker trains a slice of each step; ``async``: each worker trains
    whole steps on the parameters it pulled from the parameter-server shards, and updates
    are applied as they come, up to ``max_staleness`` stale (``--mode``; docs/async.md);
    ``diloco``: ``sync_every`` inner steps alone, then an outer step together (docs/diloco.md)."""
    sync_every: int = 50
    """``diloco``: inner steps per outer step, H (``--sync-every``)."""
    outer_lr: float = 0.7
    """``diloco``: the outer SGD's rate and momentum (``--outer-lr``, ``--outer-momentum``)."""
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    outer_reduce: Literal["fp32", "bf16"] = "fp32"
    """``diloco``: the pseudo-gradient's all-reduce dtype (``--outer-reduce``; bf16 halves it)."""
    fragments: int = 1
    """``diloco``: Streaming DiLoCo (``--fragments F``, ``--fragment-delay τ``; docs/diloco.md)."""
    fragment_delay: int = 0
    max_staleness: int = 4
    """``async``: an update computed on a version more than this many updates old is not
    applied; its worker pulls again and recomputes (``--max-staleness``)."""
    staleness_lr: Literal["none", "inverse"] = "none"
    """``async``: ``inverse`` divides an update's learning rate by staleness + 1
    (``--staleness-lr``)."""
    ps_shards: int = 1
    """``async``: parameter-server shards, each a Ray actor holding a contiguous part of the
    parameters and its optimizer state (``--ps-shards``)."""
    ps_device: Literal["cpu", "cuda"] = "cpu"
    """``async``: where the shards keep that state: ``cuda`` runs their optimizer steps on a
    GPU (each shard takes ``PS_GPU_SHARE`` of one), at the price of GPU memory and capacity
    the workers then do not have (``--ps-device``; docs/async.md)."""
    balance: bool = False
    """Split each step's global batch in proportion to the workers' measured speed, so that
    a slow worker gets fewer samples; the result is the same as with equal slices
    (``--balance``; docs/sync.md)."""
    prefetch: bool | None = None
    """Collate the next step's batch on a background thread while the current step computes
    (``--prefetch`` / ``--no-prefetch``). None: on a GPU, where the training thread waits for
    the device and the copy from pinned memory overlaps; not on a CPU, where the two threads
    contend for Python's GIL (measured: docs/BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        _require(self.steps >= 0, f"steps must be >= 0, got {self.steps} (--steps)")
        _require(self.global_batch > 0,
                 f"global_batch must be positive, got {self.global_batch} (--global-batch)")
        _require(self.micro_batch is None or self.micro_batch > 0,
                 f"micro_batch must be positive, got {self.micro_batch} (--micro-batch)")
        _require(self.warmup_steps >= 0,
                 f"warmup_steps must be >= 0, got {self.warmup_steps} (--warmup-steps)")
        _require(self.lr_schedule in SCHEDULES,
                 f"lr_schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r} (--lr-schedule)")
        _require(self.decay_steps is None or self.decay_steps > 0,
                 f"decay_steps must be positive, got {self.decay_steps} (--decay-steps)")
        _require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio} (--min-lr-ratio)")
        _require(0 < self.decay_fraction <= 1,
                 f"decay_fraction must be in (0, 1], got {self.decay_fraction} (--decay-fraction)")
        if self.lr_schedule != "constant" and self.steps:
            _require(self.decay_end() > self.warmup_steps,
                     f"--lr-schedule {self.lr_schedule} decays after the warmup, until --decay-steps (default: "
                     f"--steps), but that is {self.decay_end()}, not after --warmup-steps {self.warmup_steps}: "
                     "raise --decay-steps or lower --warmup-steps")
        _require(self.eval_every is None or self.eval_every > 0,
                 f"eval_every must be positive, got {self.eval_every} (--eval-every)")
        _require(self.eval_batches is None or self.eval_batches > 0,
                 f"eval_batches must be positive, got {self.eval_batches} (--eval-batches)")
        _require(self.eval_batches is None or self.eval_every is not None,
                 "--eval-batches sets how much of the eval set --eval-every evaluates: add --eval-every or drop it")
        _require(self.eval_every is None or self.mode != "async",
                 "--eval-every evaluates between synchronous steps; --mode async has none yet: drop it, or use "
                 "--mode sync")
        _require(self.lr_reference_batch is None or self.lr_reference_batch > 0,
                 f"lr_reference_batch must be positive, got {self.lr_reference_batch} "
                 "(--lr-reference-batch)")
        _require(self.clip_grad_norm is None or self.clip_grad_norm > 0,
                 f"clip_grad_norm must be positive, got {self.clip_grad_norm} (--clip-grad-norm)")
        _require(self.precision in ("fp32", "bf16"),
                 f"precision must be 'fp32' or 'bf16', got {self.precision!r} (--precision)")
        _require(self.batch_stats in ("local", "global"),
                 f"batch_stats must be 'local' or 'global', got {self.batch_stats!r} (--batch-stats)")
        _require(self.batch_stats == "local" or self.micro_batch is None,
                 "--batch-stats global computes batch-norm statistics over the global batch in one forward per "
                 "worker: drop --micro-batch, or use --batch-stats local")
        _require(self.batch_stats == "local" or self.mode == "sync",
                 "--batch-stats global normalises over a synchronous step's global batch; --mode async trains "
                 "whole steps on one worker, whose statistics are the global batch's already: drop it")
        _require(self.bucket_mb > 0, f"bucket_mb must be positive, got {self.bucket_mb} (--bucket-mb)")
        _require(self.first_bucket_mb is None or self.first_bucket_mb > 0,
                 f"first_bucket_mb must be positive, got {self.first_bucket_mb} (--first-bucket-mb)")
        _require(self.zero in (0, 1, 2, 3), f"zero must be stage 0, 1, 2 or 3, got {self.zero!r} (--zero)")
        _require(self.reshard_after_forward or self.zero == 3,
                 "--no-reshard-after-forward is a ZeRO stage 3 setting: add --zero 3 or drop it")
        _require(self.init in ("auto", "whole", "units"),
                 f"init must be 'auto', 'whole' or 'units', got {self.init!r} (--init)")
        _require(self.mode in ("sync", "async", "diloco"),
                 f"mode must be sync, async or diloco, got {self.mode!r} (--mode)")
        _require(self.sync_every >= 1, f"sync_every must be >= 1, got {self.sync_every} (--sync-every)")
        _require(self.outer_lr > 0, f"outer_lr must be positive, got {self.outer_lr} (--outer-lr)")
        _require(self.outer_reduce in ("fp32", "bf16"),
                 f"outer_reduce must be fp32 or bf16, got {self.outer_reduce!r} (--outer-reduce)")
        _require(0 <= self.outer_momentum < 1,
                 f"outer_momentum must be in [0, 1), got {self.outer_momentum} (--outer-momentum)")
        _require(self.fragments >= 1, f"fragments must be >= 1, got {self.fragments} (--fragments)")
        _require(self.fragment_delay >= 0, f"fragment_delay must be >= 0, got {self.fragment_delay} (--fragment-delay)")
        if self.mode == "diloco":
            _require(not self.zero, f"--mode diloco keeps the outer state whole on every worker: drop --zero "
                                    f"{self.zero} (or use --mode sync)")
            _require(not self.balance, "--balance splits a synchronous step between workers; --mode diloco trains "
                                       "equal slices: drop one of them")
            _require(self.batch_stats == "local", "--batch-stats global normalises over a synchronous step's "
                                                  "global batch; --mode diloco's inner steps are each worker's own")
            _require(not self.prefetch, "--prefetch collates a synchronous step's slice ahead; --mode diloco's "
                                        "windows collate each inner step's: drop one of them")
            _require(not self.eval_every or self.eval_every % self.sync_every == 0,
                     f"--mode diloco evaluates at outer steps: --eval-every {self.eval_every} must be a multiple "
                     f"of --sync-every {self.sync_every}")
            _require(self.fragments <= self.sync_every, f"--fragments {self.fragments} syncs each fragment at its "
                     f"own inner step of a window: at most --sync-every {self.sync_every} of them")
            _require(self.fragment_delay < self.sync_every // self.fragments, f"--fragment-delay "
                     f"{self.fragment_delay} must be under the inner steps between two fragments' syncs, --sync-every "
                     f"{self.sync_every} // --fragments {self.fragments} = {self.sync_every // self.fragments}")
        _require(self.max_staleness >= 0,
                 f"max_staleness must be >= 0, got {self.max_staleness} (--max-staleness)")
        _require(self.staleness_lr in ("none", "inverse"),
                 f"staleness_lr must be none or inverse, got {self.staleness_lr!r} (--staleness-lr)")
        _require(self.ps_shards >= 1, f"ps_shards must be >= 1, got {self.ps_shards} (--ps-shards)")
        _require(self.ps_device in ("cpu", "cuda"), f"ps_device must be cpu or cuda, got {self.ps_device!r} (--ps-device)")
        _require(self.ps_device == "cpu" or self.mode == "async",
                 "--ps-device places the parameter servers of --mode async: add --mode async or drop it")
        _require(not (self.mode == "async" and self.zero),
                 f"--mode async shards the optimizer state on its parameter servers already: drop --zero "
                 f"{self.zero} (or use --mode sync)")
        _require(not (self.mode == "async" and self.prefetch),
                 "--prefetch collates a synchronous step's slice ahead; --mode async computes one whole step per "
                 "lease: drop one of them")
        _require(not (self.mode == "async" and self.balance),
                 "--balance splits a synchronous step between workers; --mode async trains whole steps per "
                 "worker: drop one of them")
        _require(self.snapshot_every >= 1,
                 f"snapshot_every must be >= 1, got {self.snapshot_every} (--snapshot-every)")
        _require(self.on_nonfinite in ("skip", "fail"),
                 f"on_nonfinite must be 'skip' or 'fail', got {self.on_nonfinite!r} (--on-nonfinite)")
        _require(self.max_nonfinite_steps >= 1,
                 f"max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps} (--max-nonfinite-steps)")

    def first_bucket_bytes(self, device_type: str) -> int:
        """Where the first gradient bucket closes, in bytes, for workers on ``device_type``
        (``first_bucket_mb``; at most ``bucket_mb``)."""
        mb = self.first_bucket_mb
        if mb is None:
            mb = 1.0 if device_type == "cuda" else self.bucket_mb
        return int(min(mb, self.bucket_mb) * 2**20)

    def decay_end(self) -> int:
        """``decay_steps``, or ``steps`` when it is None."""
        return self.steps if self.decay_steps is None else self.decay_steps

    def lr_scaling(self) -> float:
        """The linear-scaling factor: ``global_batch / lr_reference_batch``, or 1."""
        return 1.0 if self.lr_reference_batch is None else self.global_batch / self.lr_reference_batch

    def lr_factor(self, step: int) -> float:
        """Multiplier on every param group's base learning rate at ``step`` (0-based): the
        schedule's factor times the linear-scaling factor."""
        return self.lr_scaling() * schedule_factor(
            self.lr_schedule, step, warmup=self.warmup_steps, decay_steps=self.decay_end(),
            min_ratio=self.min_lr_ratio, decay_fraction=self.decay_fraction)

    @property
    def init_by_units(self) -> bool:
        """The meta-device rule (``--init units``, or ``auto`` at ``--zero 3``)."""
        return self.init == "units" or (self.init == "auto" and self.zero == 3)


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """Where and how the workers run."""

    workers: int = 2
    """Worker actors, one model replica each; the most the run uses (``--workers N`` or the
    MAX of ``--workers MIN:MAX``)."""
    min_workers: int | None = None
    """Fewest workers the run trains with (MIN of ``--workers MIN:MAX``); None: ``workers``.
    Training starts once this many are placed and continues while this many are alive."""
    min_wait_timeout_s: float = 300.0
    """Below ``min_workers``, how long to wait for capacity to return before failing
    (``--min-wait-timeout``)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``cuda``: one GPU per worker with NCCL; ``cpu``: one CPU slot per worker with gloo;
    ``auto``: cuda when the cluster has GPUs (``--device``)."""
    gpus_per_worker: float = 1.0
    """With ``cuda``: the share of a GPU each worker holds, in (0, 1]; below 1, several
    workers share one GPU and talk through gloo, since NCCL refuses two ranks on one
    device (``--gpus-per-worker``)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """The collective backend: ``auto`` is NCCL for workers that each hold a whole GPU,
    gloo otherwise; gloo with CUDA tensors stages them through host memory (``--backend``)."""
    address: str | None = None
    """Ray cluster to attach to; None: ``RAY_ADDRESS`` if set, else an embedded local
    Ray (``--address``)."""
    placement_timeout_s: float = 60.0
    """How long to wait for the cluster to place every worker (``--placement-timeout``)."""
    step_timeout_s: float = 600.0
    """Deadline for one step (or one call of a re-formation) on every worker: the last
    backstop behind the hang detection below (``--step-timeout``)."""
    heartbeat_timeout_s: float = 5.0
    """A worker whose control thread does not answer a heartbeat for this long is a frozen
    process, and is replaced (``--heartbeat-timeout``)."""
    stall_floor_s: float = 5.0
    """A worker whose training thread makes no progress while its peers wait for it is
    hung after ``max(stall_floor_s, stall_factor × median step time)`` (``--stall-floor``).
    In async mode: no progress in a gradient for ``max(stall_floor_s, stall_factor ×`` the
    larger of the run's and its own median gradient time``)``."""
    stall_factor: float = 4.0
    """See ``stall_floor_s`` (``--stall-factor``)."""
    collective_timeout_s: float = 300.0
    """Timeout of each collective in the process group (``--collective-timeout``)."""
    abort_grace_s: float = 10.0
    """After a failure signal, how long a worker still in the step may take to return
    once its group is aborted; one that does not is hung and is replaced (``--abort-grace``)."""
    leave_grace_s: float = 25.0
    """A worker sent SIGTERM asks to leave at the next step boundary and exits on its own
    after this long if it was not let go by then (``--leave-grace``; a container runtime
    kills after its own grace period, Kubernetes' default is 30 s)."""

    def __post_init__(self) -> None:
        _require(self.workers > 0, f"workers must be positive, got {self.workers} (--workers)")
        _require(self.min_workers is None or 1 <= self.min_workers <= self.workers,
                 f"--workers MIN:MAX needs 1 <= MIN <= MAX, got {self.min_workers}:{self.workers}")
        _require(self.min_wait_timeout_s >= 0,
                 f"min_wait_timeout_s must be >= 0, got {self.min_wait_timeout_s} (--min-wait-timeout)")
        _require(self.device in ("auto", "cpu", "cuda"),
                 f"device must be auto, cpu or cuda, got {self.device!r} (--device)")
        _require(0 < self.gpus_per_worker <= 1,
                 f"gpus_per_worker must be in (0, 1], got {self.gpus_per_worker}: a worker holds one model "
                 "replica on one GPU (--gpus-per-worker)")
        _require(self.backend in ("auto", "nccl", "gloo"),
                 f"backend must be auto, nccl or gloo, got {self.backend!r} (--backend)")
        _require(not (self.backend == "nccl" and self.gpus_per_worker < 1),
                 f"NCCL refuses two ranks on one GPU, and --gpus-per-worker {self.gpus_per_worker} puts several "
                 "workers on one: use --backend gloo (or auto), or --gpus-per-worker 1")
        if self.min_workers is None:
            self.min_workers = self.workers
        for name, flag in (("placement_timeout_s", "--placement-timeout"), ("step_timeout_s", "--step-timeout"),
                           ("collective_timeout_s", "--collective-timeout"), ("abort_grace_s", "--abort-grace"),
                           ("heartbeat_timeout_s", "--heartbeat-timeout"), ("stall_floor_s", "--stall-floor"),
                           ("stall_factor", "--stall-factor"), ("leave_grace_s", "--leave-grace")):
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)} ({flag})")

    def backend_for(self, device: str) -> str:
        """The collective backend of workers on ``device`` (``cpu`` or ``cuda``)."""
        if self.backend == "nccl" and device != "cuda":
            raise ConfigError("--backend nccl needs GPUs, and the workers run on the CPU: use --backend gloo "
                              "(or auto), or --device cuda")
        if self.backend != "auto":
            return self.backend
        return "nccl" if device == "cuda" and self.gpus_per_worker >= 1 else "gloo"


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Durable checkpoints (see elastic_dp.durable.checkpoint for the format)."""

    dir: str | None = None
    """Local directory (or shared mount) that holds the checkpoints (``--checkpoint-dir``)."""
    storage: str | None = None
    """Storage URI for this and other runs' checkpoints (``--storage``): a path, or a
    pyarrow filesystem URI such as ``s3://bucket/prefix?endpoint_override=host:port``.
    Each run keeps its checkpoints under its name (``--run-name``). Use ``dir`` or
    ``storage``; neither: no checkpoints."""
    every: int = 0
    """Save after every ``every`` committed steps and after the last one
    (``--checkpoint-every``); 0: only after the last step."""
    resume: bool | str | None = None
    """``never``; ``latest`` (or True: ``--resume``): continue from the latest checkpoint,
    which must exist; ``auto``: continue from this run's latest checkpoint if there is one,
    else start fresh (``--resume auto``). None: ``auto`` with ``storage``, else ``never``."""
    keep: int = 3
    """How many of the newest checkpoints to keep (``--checkpoint-keep``)."""
    asynchronous: bool = True
    """Write checkpoints in the background while training goes on; training waits only
    for each rank's copy into host memory (``--sync-checkpoints`` turns it off)."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"checkpoint every must be >= 0, got {self.every} (--checkpoint-every)")
        _require(self.keep >= 1, f"checkpoint keep must be >= 1, got {self.keep} (--checkpoint-keep)")
        _require(self.dir is None or self.storage is None,
                 "pass either --checkpoint-dir DIR or --storage URI, not both")
        if self.resume is None:
            self.resume = "auto" if self.storage is not None else "never"
        self.resume = {True: "latest", False: "never"}.get(self.resume, self.resume)
        _require(self.resume in ("never", "latest", "auto"),
                 f"resume must be never, latest or auto, got {self.resume!r} (--resume)")
        _require(self.resume == "never" or self.enabled,
                 "resume needs checkpoints: pass --checkpoint-dir DIR or --storage URI with --resume")

    @property
    def enabled(self) -> bool:
        return self.dir is not None or self.storage is not None


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """What a run reports besides metrics.jsonl and events.jsonl."""

    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one worker's device, for model FLOPs utilisation
    (``--peak-tflops``). None: from a table of known GPUs (bf16); no MFU on CPUs."""
    tensorboard: str | None = None
    """Write TensorBoard event files here (``--tensorboard``). None: none."""
    ray_metrics: bool = True
    """Export the figures as Ray metrics for Prometheus (``--no-ray-metrics`` turns it off)."""
    name: str | None = None
    """The run's name (``--run-name``): where its checkpoints live under ``--storage``, and
    the ``run`` tag of its Ray metrics. None: derived from the job and the settings that
    make it this run (``run_name``), so the same command resumes the same run."""

    def __post_init__(self) -> None:
        _require(self.peak_tflops is None or self.peak_tflops > 0,
                 f"peak_tflops must be positive, got {self.peak_tflops} (--peak-tflops)")


def check_batch_fits(train: TrainConfig, cluster: ClusterConfig) -> None:
    """Every worker needs at least one sample of each global batch."""
    _require(train.global_batch >= cluster.workers,
             f"global batch {train.global_batch} is smaller than the {cluster.workers} workers: "
             "raise --global-batch or lower --workers (MAX of --workers MIN:MAX)")


def run_settings(job: str, train: TrainConfig) -> dict[str, object]:
    """The settings that make a run this run: a checkpoint of another run is not resumed
    by ``--resume auto``. The worker count, ZeRO stage, micro-batch and ``--steps`` are
    not among them: a run may continue at any of those."""
    return {"job": job, "global_batch": train.global_batch, "seed": train.seed,
            "warmup_steps": train.warmup_steps, "lr_reference_batch": train.lr_reference_batch,
            **({} if train.lr_schedule == "constant" else {
                "lr_schedule": train.lr_schedule, "decay_steps": train.decay_end(), "min_lr_ratio": train.min_lr_ratio,
                **({"decay_fraction": train.decay_fraction} if train.lr_schedule == "wsd" else {})}),
            "clip_grad_norm": train.clip_grad_norm, "precision": train.precision,
            **({} if train.batch_stats == "local" else {"batch_stats": train.batch_stats})}


def run_name(settings: dict[str, object]) -> str:
    """The default run name: the job's short name and a hash of ``settings``."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return f"{str(settings['job']).split(':')[0].rsplit('.', 1)[-1]}-{digest}"
