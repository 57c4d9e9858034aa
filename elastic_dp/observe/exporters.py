"""Where a run's figures go besides metrics.jsonl and events.jsonl (which stay the source
of truth): TensorBoard event files, through TensorBoard's own writer (torch's
``SummaryWriter``), and Ray metrics for Prometheus (``RayMetrics``, below).

Per committed step: ``train/loss``, ``train/lr`` (the first param group's),
``train/grad_norm`` (with clipping), ``throughput/samples_per_s``, ``throughput/tokens_per_s``
and ``throughput/mfu`` (when the task declares them), ``cluster/world_size``,
``time/step_s`` and the breakdown ``time/compute_s``, ``time/reduce_wait_s``,
``time/optimizer_s``, ``time/snapshot_s``, ``time/other_s``. Membership changes,
restores are marked: ``cluster/membership_changes`` counts them at the step they took
effect; the ``events`` text tab says what each was, and what else happened (skipped
non-finite steps, a resume, re-formations interrupted, faults that never fired).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_dp.durable.storage import probe_writable
from elastic_dp.errors import ConfigError

SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "samples_per_s": "throughput/samples_per_s", "tokens_per_s": "throughput/tokens_per_s",
           "mfu": "throughput/mfu", "world_size": "cluster/world_size", "step_s": "time/step_s",
           "compute_s": "time/compute_s", "reduce_wait_s": "time/reduce_wait_s", "optimizer_s": "time/optimizer_s",
           "snapshot_s": "time/snapshot_s", "other_s": "time/other_s"}
CHANGES = ("membership_changed", "restored_from_checkpoint")
MARKED = (*CHANGES, "nonfinite_step", "resumed", "reform_interrupted", "fault_not_fired")


class TensorBoard:
    """Writes a run's scalars and marks for TensorBoard into ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        try:  # refuse now, before any worker starts, rather than after the first step
            probe_writable(directory)
        except OSError as exc:
            raise ConfigError(f"the TensorBoard directory {str(directory)!r} cannot be written "
                              f"({exc.strerror or exc}): pass a writable --tensorboard DIR") from None
        self.directory = directory
        self._writer = None  # opened at the first record: a run that fails to start leaves no file
        self.changes = 0
        self.last_step = 0

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(str(self.directory))
        return self._writer

    def step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        self.last_step = step
        for key, tag in SCALARS.items():
            value = record.get(key)
            if value is not None:
                self.writer.add_scalar(tag, value, step, walltime=record["time"])

    def evaluation(self, record: dict[str, Any]) -> None:
        self.writer.add_scalar("eval/loss", record["eval_loss"], record["step"], walltime=record["time"])

    def event(self, record: dict[str, Any]) -> None:
        if record["kind"] not in MARKED:
            return
        step = record.get("step", self.last_step)
        if record["kind"] in CHANGES:
            self.changes += 1
            self.writer.add_scalar("cluster/membership_changes", self.changes, step, walltime=record["time"])
        fields = ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("time", "kind"))
        self.writer.add_text("events", f"{record['kind']}: {fields}", step, walltime=record["time"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()


GAUGES = ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "mfu", "world_size", "generation", "step_s",
          "compute_s", "reduce_wait_s", "optimizer_s", "snapshot_s", "other_s")
COUNTERS = {"steps": "committed steps (a step trained again counts again)",
            "failures": "failures recovered from (workers lost in a step, a save or a re-formation)",
            "reformations": "groups formed after a failure or a join",
            "restores": "restarts from the durable checkpoint",
            "skipped_steps": "steps skipped for a non-finite loss or gradient"}


class RayMetrics:
    """The same figures as Ray metrics (``ray.util.metrics``), tagged ``run=<name>``: the
    node's metrics agent serves them to Prometheus (the Ray dashboard's Grafana, a KubeRay
    PodMonitor) as ``ray_elastic_dp_<figure>`` gauges and ``ray_elastic_dp_<count>_total``
    counters. Needs Ray to be initialised."""

    def __init__(self, run: str) -> None:
        from ray.util.metrics import Counter, Gauge

        self.tags = {"run": run}
        self.gauges = {k: Gauge(f"elastic_dp_{k}", description=f"elastic_dp: {k} of the last committed step",
                                tag_keys=("run",)) for k in GAUGES}
        self.counters = {k: Counter(f"elastic_dp_{k}", description=f"elastic_dp: {text}", tag_keys=("run",))
                         for k, text in COUNTERS.items()}
        self.eval_gauge = Gauge("elastic_dp_eval_loss", description="elastic_dp: loss of the last evaluation",
                                tag_keys=("run",))

    def step(self, record: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            if record.get(key) is not None:
                gauge.set(float(record[key]), tags=self.tags)
        self.counters["steps"].inc(1, tags=self.tags)
        if record.get("nonfinite"):
            self.counters["skipped_steps"].inc(1, tags=self.tags)

    def evaluation(self, record: dict[str, Any]) -> None:
        self.eval_gauge.set(float(record["eval_loss"]), tags=self.tags)

    def event(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind in CHANGES:
            self.counters["reformations"].inc(1, tags=self.tags)
        if kind == "restored_from_checkpoint":
            self.counters["restores"].inc(1, tags=self.tags)
        if (kind in CHANGES and record.get("lost")) or kind == "reform_interrupted":
            self.counters["failures"].inc(1, tags=self.tags)

    def close(self) -> None:
        pass  # Ray's metrics agent keeps serving the last values while the driver lives
