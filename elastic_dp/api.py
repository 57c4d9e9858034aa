"""The public entry point: ``Trainer``.

Example (a complete one is in the README)::

    from elastic_dp import Trainer, TrainConfig, ClusterConfig
    from jobs.gpt import TASK

    summary = Trainer(TASK, train=TrainConfig(steps=50, global_batch=32),
                      cluster=ClusterConfig(workers=2), out_dir="runs/gpt").fit()
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import ray

from elastic_dp.config import (
    CheckpointConfig,
    ClusterConfig,
    MetricsConfig,
    TrainConfig,
    check_batch_fits,
    run_name,
    run_settings,
)
from elastic_dp.control.coordinator import Coordinator
from elastic_dp.control.membership import Membership
from elastic_dp.control.membership.pool import WorkerPool
from elastic_dp.data import ElasticSampler
from elastic_dp.data.raydata import with_ray_data
from elastic_dp.durable.checkpoint import CheckpointStore
from elastic_dp.durable.storage import Storage
from elastic_dp.errors import ClusterError, ConfigError, ElasticDPError
from elastic_dp.faults import Fault, FaultPlan, parse_faults
from elastic_dp.modes.asyncsgd.mode import PS_GPU_SHARE
from elastic_dp.modes.context import ModeContext
from elastic_dp.modes.registry import make_mode
from elastic_dp.observe.exporters import RayMetrics
from elastic_dp.observe.metrics import RunRecorder, RunSummary, Throughput
from elastic_dp.schedules import check_sources
from elastic_dp.task import Task

logger = logging.getLogger(__name__)


class Trainer:
    """Synchronous data-parallel training of a ``Task`` on Ray worker actors.

    ``cluster.min_workers``..``cluster.workers`` is the elastic range; ``inject`` takes
    fault specs (``"kill:step=5:rank=1"``, see elastic_dp.faults) for validating a setup.
    """

    def __init__(self, task: Task, *, train: TrainConfig | None = None,
                 cluster: ClusterConfig | None = None, checkpoint: CheckpointConfig | None = None,
                 out_dir: str | None = None, progress: bool | None = None,
                 inject: list[str | Fault] = (), metrics: MetricsConfig | None = None) -> None:
        self.task = task
        self.train = train or task.defaults
        self.cluster = cluster or ClusterConfig()
        self.checkpoint = checkpoint or CheckpointConfig()
        self.out_dir = out_dir
        self.metrics = metrics or MetricsConfig()
        check_batch_fits(self.train, self.cluster)
        check_sources(task, self.train)
        self.train.mode.check_run(self.train, self.cluster, self.checkpoint)
        if self.train.eval_every and task.eval_dataset is None:
            raise ConfigError("--eval-every evaluates the task's Task.eval_dataset, and this task has none: give it "
                              "one (a factory of a held-out dataset), or drop --eval-every")
        self.progress = progress
        self.faults = parse_faults(inject, self.train, self.cluster, self.checkpoint)
        for uri, setting in ((self.checkpoint.storage, "--storage"), (self.checkpoint.dir, "--checkpoint-dir")):
            if uri is not None:
                Storage(uri, setting)  # an unknown scheme or an endpoint that does not answer: refused now
        self.settings = run_settings(job_name(task), self.train)
        self.name = self.metrics.name or run_name(self.settings)
        """The run's name: its checkpoints' prefix under ``checkpoint.storage`` and its metrics' tag."""

    def fit(self) -> RunSummary:
        """Train to ``train.steps``; attaches to Ray, or starts an embedded local Ray."""
        check_before_ray(self.checkpoint, self.name)
        probe = DatasetProbe(self.task) if _starts_local_ray(self.cluster) else None
        if probe is not None:
            probe.check(self.train, wait_s=DatasetProbe.WAIT_S)
        recorder = RunRecorder(self.out_dir, total_steps=self.train.steps, progress=self.progress,
                               tensorboard=self.metrics.tensorboard)  # refuses an unwritable one now
        peak = self.metrics.peak_tflops
        recorder.throughput = Throughput(self.task.tokens_per_sample, self.task.flops_per_sample,
                                         peak * 1e12 if peak else None)
        try:
            started = _ensure_ray(self.cluster)
        except BaseException:
            recorder.close()
            raise
        if self.metrics.ray_metrics:
            recorder.exporters.append(RayMetrics(self.name))
        try:
            if probe is not None:
                probe.check(self.train, wait_s=0.0)  # a dataset that was built while Ray started
            # a Ray Dataset is built and executed once, here, and its rows read by the workers;
            # the probe's build, where it failed, may have been one (Ray was not up)
            built = probe.dataset if probe is not None else None
            task = with_ray_data(self.task, built, build=probe is None or probe.finished,
                                 evaluates=bool(self.train.eval_every))
            return build_coordinator(task, self.train, self.cluster, self.checkpoint, recorder,
                                     self.faults, name=self.name, settings=self.settings).run()
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ElasticDPError):  # a worker's: shown in the caller's words
                raise exc.cause from None
            raise
        finally:
            recorder.close()
            if started:
                ray.shutdown()


def build_coordinator(task: Task, train: TrainConfig, cluster: ClusterConfig, checkpoint: CheckpointConfig,
                      recorder: RunRecorder, faults: list[Fault] = (), *, name: str | None = None,
                      settings: dict | None = None) -> Coordinator:
    """The parts of one run on the connected Ray cluster: the worker pool and membership,
    the training mode the configuration asks for, the checkpoint store, the coordinator.
    ``name`` and ``settings`` identify the run (``config.run_settings``): its checkpoints
    live under ``checkpoint.storage``/``name``."""
    settings = settings or run_settings(job_name(task), train)
    plan = FaultPlan(faults)
    membership = Membership(WorkerPool(task, train, cluster), min_workers=cluster.min_workers,
                            max_workers=cluster.workers, spares=cluster.spares,
                            held_back=sum(f.kind == "join" for f in faults),
                            wait_timeout_s=cluster.min_wait_timeout_s,
                            placement_timeout_s=cluster.placement_timeout_s)
    store = checkpoint_store(checkpoint, name or run_name(settings))
    if getattr(train.mode, "ps_device", "cpu") == "cuda" and ray.cluster_resources().get("GPU", 0) < PS_GPU_SHARE:
        raise ConfigError("--ps-device cuda puts the parameter servers on a GPU, and the Ray cluster has none: "
                          "use --ps-device cpu or attach to a cluster with GPUs (--address)")
    mode = make_mode(ModeContext(train=train, cluster=cluster, recorder=recorder, faults=plan, task=task,
                                 checkpoint=checkpoint, settings=settings))
    return Coordinator(mode, membership, train=train, recorder=recorder, faults=plan, store=store,
                       checkpoint=checkpoint, settings=settings)


def job_name(task: Task) -> str:
    """The job a task belongs to: its model factory, ``module:name`` (``jobs.gpt:build_model``)."""
    factory = getattr(task.model, "func", task.model)  # a functools.partial's function
    module = getattr(factory, "__module__", None) or type(factory).__module__
    return f"{module}:{getattr(factory, '__qualname__', type(factory).__qualname__)}"


def checkpoint_store(checkpoint: CheckpointConfig, name: str) -> CheckpointStore | None:
    """Where the run's checkpoints go: ``checkpoint.dir``, or the run ``name``'s prefix under
    ``checkpoint.storage``; None without either."""
    if checkpoint.dir is not None:
        return CheckpointStore(Storage(checkpoint.dir, "--checkpoint-dir"), keep=checkpoint.keep)
    if checkpoint.storage is not None:
        return CheckpointStore(Storage(checkpoint.storage, "--storage").child(name), keep=checkpoint.keep)
    return None


def check_before_ray(checkpoint: CheckpointConfig, name: str) -> None:
    """What can fail before Ray starts, fails then: a checkpoint location that cannot be a
    directory, and ``--resume`` (latest) with nothing to resume from. Nothing is created."""
    store = checkpoint_store(checkpoint, name)
    if store is None:
        return
    store.storage.check_path()
    if checkpoint.resume == "latest":
        store.load()  # a clear error, naming the location, when it holds no checkpoint


class DatasetProbe:
    """The task's dataset built once on the driver, beside Ray's start, for its length: a
    dataset smaller than one global batch is refused before Ray starts where it builds
    within ``WAIT_S`` (else as soon as it is built, before any worker is placed), not after
    the workers are set up. Only with an embedded local Ray (``_starts_local_ray``): the
    data is on this machine, which builds it for every worker anyway; a cluster's driver
    may not reach the workers' data, and the workers check it there as before. A factory
    that fails here is left to the workers, which report what fails."""

    WAIT_S = 1.0

    def __init__(self, task: Task) -> None:
        self.length: int | None = None
        self.dataset: Any = None
        """What the factory built (a Ray Dataset's factory fails here: Ray is not up)."""
        self._thread = threading.Thread(target=self._measure, args=(task,), name="edp-dataset-probe", daemon=True)
        self._thread.start()

    def _measure(self, task: Task) -> None:
        try:
            with _no_ray_auto_init():  # a Ray Dataset's factory would start Ray beside _ensure_ray
                self.dataset = task.dataset()
            self.length = len(self.dataset)
        except Exception:  # noqa: BLE001 — the workers build it too, and say what fails
            logger.debug("the dataset could not be built on the driver", exc_info=True)

    @property
    def finished(self) -> bool:
        """The build ended, in a dataset or in an error."""
        return not self._thread.is_alive()

    def check(self, train: TrainConfig, wait_s: float) -> None:
        """Raise ConfigError (``ElasticSampler``'s) if the length, once known within
        ``wait_s``, is under one global batch."""
        self._thread.join(wait_s)
        if self.length is not None:
            ElasticSampler(self.length, global_batch=train.global_batch, seed=train.seed)


@contextlib.contextmanager
def _no_ray_auto_init() -> Iterator[None]:
    """Ray's APIs (Ray Data's builders among them) do not start Ray on their own in the
    block: they raise instead. Ray reads the switch (``RAY_ENABLE_AUTO_CONNECT``) once, into
    a module of its own; without that module nothing is switched."""
    try:
        from ray._private import auto_init_hook
    except ImportError:
        yield
        return
    before, auto_init_hook.enable_auto_connect = auto_init_hook.enable_auto_connect, False
    try:
        yield
    finally:
        auto_init_hook.enable_auto_connect = before


def _starts_local_ray(cluster: ClusterConfig) -> bool:
    """``_ensure_ray`` will start an embedded local Ray."""
    return not ray.is_initialized() and not (cluster.address or os.environ.get("RAY_ADDRESS"))


def _ensure_ray(cluster: ClusterConfig) -> bool:
    """Connect to Ray unless already connected; return True when this call started it."""
    if ray.is_initialized():
        return False
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        check_reachable(address, "--address" if cluster.address else "RAY_ADDRESS")
        ray.init(address=address, log_to_driver=True)
        return False
    # Embedded local Ray, sized so the requested workers fit even on a small laptop.
    num_cpus = max(os.cpu_count() or 1, cluster.workers)
    logger.info("starting an embedded local Ray with %d CPU slots", num_cpus)
    with _sigint_after():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 configure_logging=False, log_to_driver=True)
    return True


@contextlib.contextmanager
def _sigint_after() -> Iterator[None]:
    """SIGINT (Ctrl-C) held back until the block ends: an interrupt inside ``ray.init`` once
    left the process dead of SIGSEGV. The processes Ray starts inherit the held mask, so a
    Ctrl-C in the terminal, which reaches the whole process group, leaves them to the
    driver's shutdown. Off the main thread, nothing is held."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a held SIGINT is delivered now


def check_reachable(address: str, setting: str, timeout_s: float = 10.0) -> None:
    """Fail fast, naming ``setting``, when nothing answers at a Ray ``address`` (``host:port``
    or ``ray://host:port``): ``ray.init`` would retry for minutes. ``auto`` and ``local``
    are Ray's to resolve."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterError(f"no Ray cluster answers at {address} ({exc.strerror or exc}): pass the address of a "
                           f"running cluster's head (--address or RAY_ADDRESS; this one came from {setting}), "
                           "or leave both unset to start an embedded local Ray") from None

