"""Configuration: one small dataclass per concern, validated at construction.

Each error names the field and the CLI flag that sets it, so a user knows what to change.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from elastic_dp.comm.settings import Buckets
from elastic_dp.errors import API_NAMES, ConfigError
from elastic_dp.modes.asyncsgd.settings import AsyncSettings
from elastic_dp.modes.diloco.settings import DiLoCoSettings
from elastic_dp.modes.sync.settings import SyncSettings
from elastic_dp.schedules import SCHEDULES, schedule_factor
from elastic_dp.settings import OMIT, api_names, build, choice, identity, parts_of, refuse_unplaced, setting
from elastic_dp.state.zero.settings import Stage, Stage0

MODES = {"sync": SyncSettings, "async": AsyncSettings, "diloco": DiLoCoSettings}
"""The training modes, by name (``--mode``): each one's settings part, which names its
driver half and its worker program (``modes.registry``). Adding a mode is its package
under ``elastic_dp.modes`` and one line here."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _unless_constant(value: Any, train: "TrainConfig") -> Any:
    """A decay's setting names the run only where the schedule decays."""
    return OMIT if train.lr_schedule == "constant" else value


@dataclass(kw_only=True, slots=True, init=False)
class TrainConfig:
    """A run's settings: its core (steps, batch, seed, learning-rate schedule, precision,
    evaluation, the non-finite guard, how the model is built), declared here, and its
    training mode's part (``mode``), which holds the mode's settings and its own parts
    (sync: the ZeRO stage's and the gradient buckets'). None depends on the number of workers.

    Every setting is given by its name, wherever it is declared: ``TrainConfig(zero=2,
    bucket_mb=5)`` puts ``zero`` and ``bucket_mb`` in the sync mode's part (the default
    mode). A part may also be given whole (``mode=DiLoCoSettings(sync_every=10)``). A
    setting that no chosen part reads is refused, naming it (``elastic_dp.settings``);
    ``dataclasses.replace`` routes the same way, and a new mode or stage starts from its
    own defaults."""

    steps: int = setting(100, "--steps", "optimizer steps to reach (a resumed run continues to S)")
    global_batch: int = setting(32, "--global-batch", "samples per step over all workers; fixed for the run, "
                                "whatever the worker count", identity=True)
    micro_batch: int | None = setting(None, "--micro-batch", "most samples one worker puts through one "
                                      "forward/backward; a larger slice accumulates (default: the whole slice)",
                                      kind=int)
    seed: int = setting(0, "--seed", "seeds model initialisation and the sampler's shuffles", identity=True)
    warmup_steps: int = setting(0, "--warmup-steps", "linear learning-rate warmup from 0 over this many steps",
                                identity=True)
    lr_schedule: Literal["constant", "cosine", "linear", "wsd"] = setting(
        "constant", "--lr-schedule", choices=tuple(SCHEDULES), identity=_unless_constant, help=(
            "after the warmup: constant (default); cosine or linear decay to --min-lr-ratio at --decay-steps; wsd: "
            "constant, then a linear decay over the last --decay-fraction of --decay-steps "
            "(elastic_dp.schedules.schedule_factor)"))
    decay_steps: int | None = setting(
        None, "--decay-steps", "the step at which the decay reaches --min-lr-ratio (default: --steps)", kind=int,
        identity=lambda value, train: _unless_constant(train.decay_end(), train))
    min_lr_ratio: float = setting(0.1, "--min-lr-ratio", "the decayed rate, as a fraction of the base rate "
                                  "(default 0.1)", identity=lambda value, train: _unless_constant(value, train))
    decay_fraction: float = setting(
        0.1, "--decay-fraction", "wsd: the fraction of --decay-steps that the decay takes (default 0.1)",
        identity=lambda value, train: value if train.lr_schedule == "wsd" else OMIT)
    eval_every: int | None = setting(
        None, "--eval-every", "evaluate Task.eval_dataset after every this many committed steps, and after the "
        "last (default: no evaluation)", kind=int)
    eval_batches: int | None = setting(None, "--eval-batches", "evaluate on the first this many global batches of "
                                       "the eval set (default: all of it)", kind=int)
    lr_reference_batch: int | None = setting(
        None, "--lr-reference-batch", "linear scaling rule: the optimizer's learning rates times "
        "--global-batch / this", kind=int, identity=True)
    clip_grad_norm: float | None = setting(None, "--clip-grad-norm", "clip gradients to this global L2 norm before "
                                           "each update", kind=float, identity=True)
    precision: Literal["fp32", "bf16"] = setting("fp32", "--precision", "bf16: forward/backward under bf16 autocast",
                                                 choices=("fp32", "bf16"), identity=True)
    on_nonfinite: Literal["skip", "fail"] = setting(
        "skip", "--on-nonfinite", choices=("skip", "fail"), help=(
            "a step whose loss or gradient is not finite makes no update on any rank; skip (default) goes on with "
            "the next step (the skipped one counts as trained, a no-op), fail ends the run naming the step and rank"))
    max_nonfinite_steps: int = setting(5, "--max-nonfinite-steps", "with skip: fail after this many consecutive "
                                       "skipped steps (default 5)")
    init: Literal["auto", "whole", "units"] = setting(
        "auto", "--init", choices=("auto", "whole", "units"), help=(
            "how the initial parameters are made: whole runs the task's model factory as it is; units builds it on "
            "the meta device and materialises and initialises each shard unit on its own under its seed "
            "(docs/zero.md, the initialisation rule), so that at --zero 3 no worker holds the whole model; auto "
            "(default): units at --zero 3, whole otherwise"))
    activation_checkpointing: bool = setting(False, "--activation-checkpointing", help=(
        "recompute each shard unit's activations in its backward instead of keeping them (any --zero stage)"))
    mode: Any = choice(MODES, "sync", "--mode", help=(
        "sync: every worker trains a slice of each step; async: each worker trains whole steps on parameters "
        "pulled from parameter-server shards, applied as they come (docs/async.md); diloco: --sync-every inner "
        "steps alone, then an outer step together (docs/diloco.md)"))

    def __init__(self, **given: Any) -> None:
        given = dict(given)
        for name, value in build(TrainConfig, given).items():
            setattr(self, name, value)
        refuse_unplaced(self, given)
        self._check()
        for part_of_run in parts_of(self):
            check = getattr(part_of_run, "check", None)
            if check is not None:
                check(self)

    def _check(self) -> None:
        """The core's own bounds (the declared choices are checked as they are given: ``settings.build``)."""
        _require(self.steps >= 0, f"steps must be >= 0, got {self.steps} (--steps)")
        _require(self.global_batch > 0,
                 f"global_batch must be positive, got {self.global_batch} (--global-batch)")
        _require(self.micro_batch is None or self.micro_batch > 0,
                 f"micro_batch must be positive, got {self.micro_batch} (--micro-batch)")
        _require(self.warmup_steps >= 0,
                 f"warmup_steps must be >= 0, got {self.warmup_steps} (--warmup-steps)")
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
        _require(self.lr_reference_batch is None or self.lr_reference_batch > 0,
                 f"lr_reference_batch must be positive, got {self.lr_reference_batch} "
                 "(--lr-reference-batch)")
        _require(self.clip_grad_norm is None or self.clip_grad_norm > 0,
                 f"clip_grad_norm must be positive, got {self.clip_grad_norm} (--clip-grad-norm)")
        _require(self.max_nonfinite_steps >= 1,
                 f"max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps} (--max-nonfinite-steps)")

    @property
    def stage(self) -> Stage:
        """The ZeRO stage's part the state is sharded by (``--zero``): the sync mode's; stage
        0's in the modes that shard nothing (async keeps its state on parameter servers,
        diloco whole). Ask it what it shards (``sharded``, ``shards_parameters``), not its number."""
        return getattr(self.mode, "zero", None) or Stage0()

    @property
    def buckets(self) -> Buckets:
        """The gradient buckets' settings: the sync mode's; their defaults in the modes that
        reduce no gradients (whose replicas still build a reducer they never launch)."""
        return getattr(self.mode, "buckets", None) or Buckets()

    @property
    def global_batch_stats(self) -> bool:
        """``--batch-stats global`` (a sync setting; the other modes' statistics are local)."""
        return getattr(self.mode, "batch_stats", "local") == "global"

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
        return self.init == "units" or (self.init == "auto" and self.stage.shards_parameters)


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """Where and how the workers run."""

    workers: int = setting(2, help="worker actors, one model replica each; the most the run uses (--workers N, "
                           "or the MAX of --workers MIN:MAX)")
    min_workers: int | None = setting(None, help="fewest workers the run trains with (MIN of --workers MIN:MAX; "
                                      "None: workers): training starts once this many are placed and goes on "
                                      "while this many are alive")
    spares: int = setting(0, "--spares", "workers started and built beside the members (K), kept ready: a lost or "
                          "leaving member's place is taken by one in the same re-formation, and a new spare is "
                          "started in its place (default 0)", metavar="K")
    min_wait_timeout_s: float = setting(300.0, "--min-wait-timeout", "below MIN workers, seconds to wait for "
                                        "capacity before failing (default 300)")
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "--device", "cuda: one GPU per worker, NCCL; cpu: one CPU slot per worker, gloo; auto (default): "
        "cuda when the cluster has GPUs", choices=("auto", "cpu", "cuda"))
    gpus_per_worker: float = setting(
        1.0, "--gpus-per-worker", "with cuda, each worker's share of a GPU, in (0, 1] (default 1); below 1 several "
        "workers share a GPU and talk through gloo (NCCL refuses two ranks on one device)")
    backend: Literal["auto", "nccl", "gloo"] = setting(
        "auto", "--backend", "the collective backend (default auto: NCCL when each worker holds a whole GPU, else "
        "gloo; gloo stages CUDA tensors through host memory)", choices=("auto", "nccl", "gloo"))
    address: str | None = setting(None, "--address", "Ray cluster to attach to (default: RAY_ADDRESS, else an "
                                  "embedded local Ray)")
    placement_timeout_s: float = setting(60.0, "--placement-timeout", "seconds to wait for the cluster to place "
                                         "every worker (default 60)")
    step_timeout_s: float = setting(600.0, "--step-timeout", "deadline of one step (or one call of a "
                                    "re-formation), seconds: the last backstop behind hang detection")
    heartbeat_timeout_s: float = setting(5.0, "--heartbeat-timeout", "a worker whose control thread leaves "
                                         "heartbeats unanswered this long is a frozen process (default 5)")
    stall_floor_s: float = setting(
        5.0, "--stall-floor", "a worker that makes no progress while its peers wait for it is hung after "
        "max(this, --stall-factor x median step time) seconds (async: in a gradient, x the larger of the run's and "
        "its own median gradient time; default 5)")
    stall_factor: float = setting(4.0, "--stall-factor", "see --stall-floor (default 4)")
    collective_timeout_s: float = setting(300.0, "--collective-timeout", "timeout of one collective in the "
                                          "process group, seconds")
    abort_grace_s: float = setting(10.0, "--abort-grace", "after a failure, seconds a worker may take to leave the "
                                   "aborted step before it counts as hung (default 10)")
    leave_grace_s: float = setting(
        25.0, "--leave-grace", "a worker sent SIGTERM leaves at the next step boundary, and exits on its own after "
        "this many seconds if it was not let go (default 25; Kubernetes' grace period is 30 s)")

    def __post_init__(self) -> None:
        _require(self.workers > 0, f"workers must be positive, got {self.workers} (--workers)")
        _require(self.min_workers is None or 1 <= self.min_workers <= self.workers,
                 f"--workers MIN:MAX needs 1 <= MIN <= MAX, got {self.min_workers}:{self.workers}")
        _require(self.spares >= 0, f"spares must be >= 0, got {self.spares} (--spares)")
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

    dir: str | None = setting(None, "--checkpoint-dir", "local directory (or shared mount) for checkpoints")
    storage: str | None = setting(
        None, "--storage", "checkpoints under URI/RUN_NAME: a path or a pyarrow filesystem URI such as "
        "s3://bucket/prefix?endpoint_override=host:port (credentials from the environment); implies --resume auto",
        metavar="URI")
    every: int = setting(0, "--checkpoint-every", "save after every K committed steps and after the last one "
                         "(0: after the last only)")
    resume: bool | str | None = setting(
        None, "--resume", "continue from the latest checkpoint, which must exist (True or latest); auto: from this "
        "run's latest if there is one, else start fresh (the default with --storage); never", kind=str,
        choices=("latest", "auto", "never"), const="latest")
    keep: int = setting(3, "--checkpoint-keep", "how many of the newest checkpoints to keep (default 3)")
    asynchronous: bool = setting(True, off="--sync-checkpoints", help=(
        "write checkpoints on the training thread (default: in the background; training waits only for each "
        "rank's copy into host memory)"))

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

    peak_tflops: float | None = setting(None, "--peak-tflops", "peak dense TFLOP/s of one worker's device, for "
                                        "model FLOPs utilisation (default: known GPUs' bf16 peak; none on CPUs)",
                                        kind=float)
    tensorboard: str | None = setting(None, "--tensorboard", "also write TensorBoard event files (scalars per "
                                      "step, membership changes) here", metavar="DIR")
    ray_metrics: bool = setting(True, off="--no-ray-metrics", help="do not export the run's figures as Ray "
                                "(Prometheus) metrics")
    name: str | None = setting(
        None, "--run-name", "the run's name: its checkpoints' prefix under --storage and the run tag of its Ray "
        "metrics (default: the job's name and a hash of the settings that make it this run)")

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
    by ``--resume auto``. Those declared with an ``identity`` (``elastic_dp.settings``): the
    worker count, the mode, the ZeRO stage, the micro-batch and ``--steps`` are not among
    them, so that a run may continue at any of those."""
    return {"job": job, **identity(train)}


def run_name(settings: dict[str, object]) -> str:
    """The default run name: the job's short name and a hash of ``settings``."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return f"{str(settings['job']).split(':')[0].rsplit('.', 1)[-1]}-{digest}"


API_NAMES.update({**api_names(TrainConfig), **api_names(ClusterConfig), **api_names(CheckpointConfig),
                  **api_names(MetricsConfig)})
