"""Run output: metrics.jsonl, events.jsonl, initial/final weights, progress and summary.

With an output directory ``DIR`` a run writes::

    DIR/initial.safetensors   model state before the first step of this run
    DIR/final.safetensors     model state after the last step
    DIR/metrics.jsonl         one line per committed step: step, time (of the commit),
                              loss, samples, step_s, world_size, generation, worker timings,
                              the coordinator's own time, samples_per_s (tokens_per_s, mfu
                              when the task declares its tokens and FLOPs per sample);
                              a step skipped for a non-finite loss or gradient has loss null
                              and nonfinite true
    DIR/events.jsonl          membership and checkpoint events, timestamped

``DIR`` may be a storage URI (``s3://bucket/runs/NAME``, see elastic_dp.durable.storage), for a
driver whose disk does not outlive it (a KubeRay head pod): rank 0 then writes the
weights straight to it, and the two logs are kept in a local staging directory and
uploaded after each checkpoint and when the run ends.

Progress is a tqdm bar when stderr is a terminal, otherwise a log line every few steps.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from elastic_dp.durable.storage import Storage
from elastic_dp.durable.weights import TensorSpecs, save_tensor_parts, save_tensors
from elastic_dp.observe.exporters import TensorBoard

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunSummary:
    """What a finished run reports."""

    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    final_loss: float | None = None
    first_loss: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    out_dir: str | None = None
    sample: str | None = None
    """The task's sample (e.g. generated text) after the last step, if it has one."""
    staleness: dict[int, int] | None = None
    """Asynchronous SGD: how many of the applied updates had each staleness."""
    recomputed: int = 0
    """Asynchronous SGD: gradients refused as too stale and computed again."""
    eval_loss: float | None = None
    """The last evaluation's loss (``--eval-every``)."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def render(self) -> str:
        lines = ["elastic_dp run summary",
                 f"  steps        {self.steps}",
                 f"  samples      {self.samples}  ({self.samples_per_s:.1f} samples/s over {self.seconds:.1f} s)"]
        if self.final_loss is not None:
            lines.append(f"  loss         {self.first_loss:.4f} (first step) -> {self.final_loss:.4f} (last step)")
        if self.eval_loss is not None:
            lines.append(f"  eval loss    {self.eval_loss:.4f} (after the last step)")
        if self.staleness is not None:
            histogram = ", ".join(f"{k}: {n}" for k, n in sorted(self.staleness.items()))
            lines.append(f"  staleness    {histogram}  (updates per staleness; {self.recomputed} recomputed)")
        lines.append(f"  events       {len(self.events)}")
        for e in self.events:
            detail = ", ".join(f"{k}={_short(v)}" for k, v in e.items() if k not in ("time", "kind"))
            lines.append(f"    - {e['kind']}: {detail}")
        if self.out_dir:
            lines.append(f"  output       {self.out_dir}")
        if self.sample:
            lines.append("  sample       " + self.sample.replace("\n", "\n               "))
        if self.out_dir:
            lines.append(f"  plots        elastic-dp report {self.out_dir}")
        return "\n".join(lines)


def _short(value: Any, limit: int = 70) -> str:
    """One event field for the one-screen summary (events.jsonl keeps the whole text)."""
    text = str(value).splitlines()[0] if str(value) else ""
    return text if len(text) <= limit else text[:limit - 1] + "…"


# dense bf16 peak TFLOP/s of one device, for model FLOPs utilisation when --peak-tflops is not given
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0}


def known_peak_tflops(device_name: str) -> float | None:
    """The table's peak for a device name such as 'NVIDIA H100 80GB HBM3' (None: unknown)."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


@dataclass(slots=True)
class Throughput:
    """What turns a step's time into samples/s, tokens/s and model FLOPs utilisation."""

    tokens_per_sample: int | None = None
    flops_per_sample: float | None = None
    peak_flops: float | None = None
    """Per worker, FLOP/s."""

    def figures(self, samples: int, step_s: float, world_size: int) -> dict[str, float]:
        rate = samples / step_s if step_s > 0 else 0.0
        out = {"samples_per_s": round(rate, 3)}
        if self.tokens_per_sample:
            out["tokens_per_s"] = round(rate * self.tokens_per_sample, 1)
        if self.flops_per_sample and self.peak_flops:
            out["mfu"] = round(rate * self.flops_per_sample / (world_size * self.peak_flops), 6)
        return out


class RunRecorder:
    """Writes a run's metrics and events and shows its progress."""

    def __init__(self, out_dir: str | None, *, total_steps: int, progress: bool | None = None,
                 tensorboard: str | None = None) -> None:
        self.storage = Storage(out_dir, "--out") if out_dir else None
        self.remote = self.storage is not None and not self.storage.local
        if self.remote:
            self.storage.check_writable()
            self.out = Path(tempfile.mkdtemp(prefix="elastic-dp-out-"))  # staging for the logs
        else:
            if self.storage is not None:
                self.storage.check_path()  # a file in the way is refused now, before anything starts
            self.out = Path(out_dir) if out_dir else None
        self._opened = False  # the output directory is touched only once there is output
        self._files = ["metrics.jsonl", "events.jsonl"]
        self.summary = RunSummary(out_dir=self.storage.url() if self.storage else None)
        self.total_steps = total_steps
        self._t0 = time.perf_counter()
        self._show_bar = sys.stderr.isatty() if progress is None else progress
        self._bar = None
        self._log_every = max(1, total_steps // 20)
        self._committed: dict[int, int] = {}  # step -> samples, of the steps recorded in this run
        self.throughput = Throughput()
        self.exporters: list = [TensorBoard(tensorboard)] if tensorboard else []

    def _open(self) -> bool:
        if self.out is not None and not self._opened:
            self.out.mkdir(parents=True, exist_ok=True)
            for name in self._files:
                (self.out / name).write_text("")
            self._opened = True
        return self.out is not None

    def _append(self, name: str, record: dict[str, Any]) -> None:
        if self._open():
            with open(self.out / name, "a") as f:
                f.write(json.dumps(record) + "\n")

    def append(self, name: str, record: dict[str, Any]) -> None:
        """One JSON line in ``<out>/name`` (``updates.jsonl`` of the asynchronous mode)."""
        if name not in self._files:
            self._files.append(name)
            if self._opened:
                (self.out / name).write_text("")
        self._append(name, record)

    def start(self, first_step: int) -> None:
        """Training starts (at ``first_step`` when resuming): show the bar from here."""
        self._t0 = time.perf_counter()
        if self._show_bar:
            from tqdm import tqdm
            self._bar = tqdm(total=self.total_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def event(self, kind: str, **fields: Any) -> None:
        record = {"time": time.time(), "kind": kind, **fields}
        self.summary.events.append(record)
        self._append("events.jsonl", record)
        for exporter in self.exporters:
            exporter.event(record)
        logger.info("event %s: %s", kind, fields)
        if kind == "checkpoint_saved":
            self.upload()

    def step(self, *, step: int, loss: float | None, samples: int, step_s: float, world_size: int,
             generation: int, timings: dict[str, float] | None = None, nonfinite: bool = False,
             lr: float | None = None, grad_norm: float | None = None, at: float | None = None) -> None:
        """A committed step; ``nonfinite``: skipped as a no-op (its loss is recorded as null);
        ``at``: when it committed (Unix seconds; default now)."""
        record = {"step": step, "time": at if at is not None else time.time(), "loss": loss, "samples": samples, "step_s": step_s,
                  "world_size": world_size, "generation": generation, **(timings or {}),
                  **self.throughput.figures(samples, step_s, world_size)}
        record.update({k: v for k, v in (("lr", lr), ("grad_norm", grad_norm), ("nonfinite", nonfinite or None))
                       if v is not None})
        self._append("metrics.jsonl", record)
        for exporter in self.exporters:
            exporter.step(record)
        s = self.summary
        s.steps += 1
        s.samples += samples
        self._committed[step] = samples
        if loss is not None:
            s.first_loss = loss if s.first_loss is None else s.first_loss
            s.final_loss = loss
        shown = "skipped (non-finite)" if loss is None else f"{loss:.4f}"
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=shown, workers=world_size, gen=generation)
        elif (step + 1) % self._log_every == 0 or step + 1 == self.total_steps or loss is None:
            # the step's index as metrics.jsonl and the report give it, then how many of the run's are done
            logger.info("gen %d step %d (%d/%d done): loss %s, %.3f s/step, %d workers",
                        generation, step, step + 1, self.total_steps, shown, step_s, world_size)

    def evaluation(self, step: int, loss: float, samples: int) -> None:
        """An evaluation with the parameters after ``step`` (0-based, the step it follows):
        a line of its own in metrics.jsonl, ``{"step", "time", "eval_loss", "eval_samples"}``."""
        record = {"step": step, "time": time.time(), "eval_loss": loss, "eval_samples": samples}
        self._append("metrics.jsonl", record)
        for exporter in self.exporters:
            exporter.evaluation(record)
        self.summary.eval_loss = loss
        if self._bar is not None:
            self._bar.set_postfix_str(f"eval loss {loss:.4f} after step {step}", refresh=False)
            self._bar.write(f"held-out loss after step {step}: {loss:.4f} over {samples} samples")
        else:
            logger.info("held-out loss after step %d: %.4f over %d samples", step, loss, samples)

    def rewind(self, to_step: int) -> None:
        """The run went back to ``to_step`` (a rollback or a checkpoint): steps from there on
        will be trained, and recorded, again. metrics.jsonl keeps both lines of such a step."""
        dropped = [s for s in self._committed if s >= to_step]
        for step in dropped:
            self.summary.samples -= self._committed.pop(step)
        self.summary.steps -= len(dropped)
        if self._bar is not None and dropped:
            self._bar.update(-len(dropped))

    def weights(self, name: str, state: dict) -> None:
        """Write ``state`` (a model state dict) as ``<out>/<name>.safetensors``."""
        if self._open():
            save_tensors(self.storage, f"{name}.safetensors", state)

    def weight_parts(self, name: str, specs: TensorSpecs, parts: Iterable[dict]) -> None:
        """Write ``<out>/<name>.safetensors`` from ``parts`` as they come (``save_tensor_parts``)."""
        if self._open():
            save_tensor_parts(self.storage, f"{name}.safetensors", specs, parts)

    def upload(self) -> None:
        """With an ``--out`` URI: copy the logs written so far to it."""
        if self.remote and self._opened:
            for name in self._files:
                self.storage.write(name, (self.out / name).read_bytes())

    def finish(self) -> RunSummary:
        if self._bar is not None:
            self._bar.close()
        self.summary.seconds = time.perf_counter() - self._t0
        self.close()
        return self.summary

    def close(self) -> None:
        """Flush and close the exporters (a failed run keeps what it wrote)."""
        for exporter in self.exporters:
            exporter.close()
        self.exporters = []
        if self.remote:
            self.upload()
            shutil.rmtree(self.out, ignore_errors=True)  # the staging copy
            self.remote = self._opened = False
