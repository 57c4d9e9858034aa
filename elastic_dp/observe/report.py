"""``elastic-dp report RUN_DIR [--out DIR]``: plots and a short report from a run's output.

Reads only ``metrics.jsonl``, ``events.jsonl`` and ``updates.jsonl`` (the source of
truth), so it works on a run directory copied from a cluster with nothing but this
package installed. Draws with matplotlib (the Agg canvas, no display needed):

    loss.png         loss against step, every membership change and restore marked
    throughput.png   samples/s and world size against wall time
    breakdown.png    per step: compute, waiting for the reduction, optimizer, snapshot,
                     the coordinator's own time (dispatch, gather, bookkeeping), and any rest
    staleness.png    asynchronous SGD only (``updates.jsonl``): how many applied updates
                     had each staleness
    report.md        the summary figures, embedding the plots

A step that was rolled back and trained again is plotted once, as last trained (the
trajectory the final weights came from). A truncated last line (a run still writing, or
cut short) is left out, and the report says so.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from elastic_dp.errors import ElasticDPError
from elastic_dp.observe.exporters import CHANGES

PHASES = ("compute_s", "parameter_wait_s", "reduce_wait_s", "optimizer_s", "snapshot_s")
"""A step's timed phases in metrics.jsonl, stacked in the breakdown; the rest of the step is "other"."""


class ReportError(ElasticDPError):
    """The run directory cannot be reported on; the message names the file."""


@dataclass(slots=True)
class RunLog:
    """A run's records, as the report reads them."""

    metrics: list[dict]
    """One per step, the last time it was trained, in step order."""
    events: list[dict]
    notes: list[str] = field(default_factory=list)
    updates: list[dict] = field(default_factory=list)
    """Asynchronous SGD: the applied updates in version order (an undone one as replaced)."""
    evaluations: list[dict] = field(default_factory=list)
    """``--eval-every``: metrics.jsonl's ``eval_loss`` lines, by the step they follow."""

    @property
    def changes(self) -> list[tuple[int, str]]:
        """(step, label) of every membership change and restore: the step it took effect at."""
        marks = []
        for e in self.events:
            if e["kind"] not in CHANGES:
                continue
            step = e.get("step", self._step_after(e["time"]))
            if e["kind"] == "restored_from_checkpoint":
                label = f"restored step {step}"
            elif e.get("lost"):
                label = f"lost {e['lost']} -> {e['world_size']}"
            else:
                label = f"+{e.get('joined', 0)} -> {e['world_size']}"
            marks.append((step, label))
        return marks

    def _step_after(self, t: float) -> int:
        later = [m["step"] for m in self.metrics if m["time"] >= t]
        return min(later) if later else self.metrics[-1]["step"] + 1


def _read_jsonl(path: Path, notes: list[str]) -> list[dict]:
    lines = path.read_text().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if number == len(lines):  # no newline after it: written in part
                notes.append(f"{path.name}: the last line is truncated (a run still writing, or cut short); "
                             "it is left out")
                continue
            raise ReportError(f"{path}:{number} is not a JSON line: is this an elastic_dp run directory?") from None
    return records


def read_run(run_dir: str | Path) -> RunLog:
    """Read a run directory (``--out`` of ``elastic-dp train``)."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{run_dir} has no metrics.jsonl: pass the directory a run wrote with --out")
    notes: list[str] = []
    by_step: dict[int, dict] = {}
    evaluations: dict[int, dict] = {}
    for record in _read_jsonl(metrics_path, notes):
        # a rolled-back step: its last training counts (an evaluation: its own line)
        (evaluations if "eval_loss" in record else by_step)[record["step"]] = record
    if not by_step:
        raise ReportError(f"{metrics_path} has no complete step yet")
    events_path = run_dir / "events.jsonl"
    events = _read_jsonl(events_path, notes) if events_path.is_file() else []
    if not events_path.is_file():
        notes.append("events.jsonl is missing: no membership changes are marked")
    updates_path = run_dir / "updates.jsonl"
    by_version = {u["version"]: u for u in _read_jsonl(updates_path, notes)} if updates_path.is_file() else {}
    return RunLog([by_step[s] for s in sorted(by_step)], events, notes, [by_version[v] for v in sorted(by_version)],
                  [evaluations[s] for s in sorted(evaluations)])


def _figure() -> Figure:
    return Figure(figsize=(8, 4.5), dpi=100, layout="constrained")


def plot_loss(log: RunLog) -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    points = [(m["step"], m["loss"]) for m in log.metrics if m["loss"] is not None]
    ax.plot([s for s, _ in points], [v for _, v in points], color="tab:blue", label="loss")
    if log.evaluations:
        ax.plot([e["step"] for e in log.evaluations], [e["eval_loss"] for e in log.evaluations], "o-",
                color="tab:green", label="eval loss", gid="eval_loss")
    skipped = [m["step"] for m in log.metrics if m.get("nonfinite")]
    if skipped:
        ax.plot(skipped, [min(v for _, v in points)] * len(skipped), "x", color="tab:red",
                label="skipped (non-finite)")
    for step, label in log.changes:
        ax.axvline(step, color="tab:orange", linestyle="--", linewidth=1, gid="change")
        ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                    fontsize=8, color="tab:orange")
    ax.set(xlabel="step", ylabel="loss", title="Loss, with membership changes and restores")
    ax.legend(loc="upper right")
    return fig


PAUSE_FACTOR = 5.0
"""Time between two steps (the end of one to the start of the next) longer than this many
median step times, and than ``PAUSE_MIN_S``, is a pause: drawn as a gap, not as a line."""
PAUSE_MIN_S = 0.5


def pauses(metrics: list[dict]) -> list[tuple[float, float]]:
    """(end of a step, start of the next) wherever the run trained nothing for a while: a
    re-formation, a wait for a joiner or for capacity, a checkpoint or an evaluation."""
    if len(metrics) < 2:
        return []
    typical = sorted(m["step_s"] for m in metrics)[len(metrics) // 2]
    gaps = [(a["time"], b["time"] - b["step_s"]) for a, b in zip(metrics, metrics[1:])]
    return [(end, start) for end, start in gaps if start - end > max(PAUSE_FACTOR * typical, PAUSE_MIN_S)]


def plot_throughput(log: RunLog) -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    t0 = log.metrics[0]["time"] - log.metrics[0]["step_s"]
    times, rates = [], []
    paused = {end for end, _ in pauses(log.metrics)}
    for m in log.metrics:
        times.append(m["time"] - t0)
        rates.append(m["samples"] / m["step_s"])
        if m["time"] in paused:  # a break in the line: nothing was trained until the next step
            times.append(m["time"] - t0)
            rates.append(float("nan"))
    ax.plot(times, rates, color="tab:blue", gid="samples_per_s")
    for end, start in pauses(log.metrics):
        ax.axvspan(end - t0, start - t0, color="tab:gray", alpha=0.2, linewidth=0, gid="pause")
    ax.set(xlabel="wall time (s)", ylabel="samples/s", title="Throughput and world size (gray: no step trained)")
    world = ax.twinx()
    world.step([m["time"] - t0 for m in log.metrics], [m["world_size"] for m in log.metrics], where="post",
               color="tab:green")
    world.set_ylabel("workers", color="tab:green")
    world.set_ylim(0, max(m["world_size"] for m in log.metrics) + 1)
    return fig


def plot_breakdown(log: RunLog) -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    steps = [m["step"] for m in log.metrics]
    bottom = [0.0] * len(steps)
    phases = [p for p in PHASES if any(p in m for m in log.metrics)]  # parameter_wait_s: ZeRO only
    parts = {p: [m.get(p, 0.0) for m in log.metrics] for p in phases}
    parts["other_s"] = [max(0.0, m["step_s"] - sum(parts[p][i] for p in phases)) for i, m in enumerate(log.metrics)]
    for name, values in parts.items():
        ax.bar(steps, values, bottom=bottom, width=1.0, label=name.removesuffix("_s").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="step", ylabel="seconds", title="Step time breakdown (slowest worker per phase)")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_lr(log: RunLog) -> Figure:
    """The first param group's learning rate at each step (``--lr-schedule``, the task's)."""
    fig = _figure()
    ax = fig.add_subplot()
    points = [(m["step"], m["lr"]) for m in log.metrics if m.get("lr") is not None]
    ax.plot([s for s, _ in points], [v for _, v in points], color="tab:purple", gid="lr")
    ax.set(xlabel="step", ylabel="learning rate", title="Learning rate (first param group)")
    return fig


def staleness_counts(log: RunLog) -> dict[int, int]:
    """How many of the applied updates had each staleness."""
    return dict(sorted(Counter(u["staleness"] for u in log.updates).items()))


def plot_staleness(log: RunLog) -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    counts = staleness_counts(log)
    ax.bar(list(counts), list(counts.values()), color="tab:blue", gid="staleness")
    ax.set_xticks(range(max(counts, default=0) + 1))
    ax.set(xlabel="staleness (updates applied between the pull and this update)", ylabel="updates",
           title=f"Staleness of the {len(log.updates)} applied updates")
    return fig


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the plots and write ``report.md`` into ``out`` (default ``RUN_DIR/report``)."""
    log = read_run(run_dir)
    out = Path(out) if out is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = {"loss.png": plot_loss(log), "throughput.png": plot_throughput(log),
             "breakdown.png": plot_breakdown(log)}
    if any(m.get("lr") is not None for m in log.metrics):
        plots["lr.png"] = plot_lr(log)
    if log.updates:
        plots["staleness.png"] = plot_staleness(log)
    for name, fig in plots.items():
        fig.savefig(out / name)
    (out / "report.md").write_text(_markdown(log, run_dir, list(plots)))
    return out


def _markdown(log: RunLog, run_dir: str | Path, plots: list[str]) -> str:
    m = log.metrics
    wall = m[-1]["time"] - (m[0]["time"] - m[0]["step_s"])
    losses = [x["loss"] for x in m if x["loss"] is not None]
    lost = sum(e.get("lost", 0) for e in log.events if e["kind"] in CHANGES)
    lines = [f"# Run report: {run_dir}", "",
             f"- steps: {len(m)} (steps {m[0]['step']}..{m[-1]['step']}), samples: {sum(x['samples'] for x in m)}",
             f"- wall time: {wall:.1f} s; median step {statistics.median(x['step_s'] for x in m):.3f} s; "
             f"{sum(x['samples'] for x in m) / wall:.1f} samples/s",
             f"- loss: {losses[0]:.4f} (first) -> {losses[-1]:.4f} (last)" if losses else "- loss: none finite",
             f"- world size: {min(x['world_size'] for x in m)}..{max(x['world_size'] for x in m)}; "
             f"membership changes and restores: {len(log.changes)}; workers lost: {lost}",
             f"- steps skipped for a non-finite loss or gradient: {sum(bool(x.get('nonfinite')) for x in m)}"]
    for key, label, unit in (("tokens_per_s", "tokens/s", ""), ("mfu", "model FLOPs utilisation", "%")):
        values = [x[key] for x in m if x.get(key) is not None]
        if values:
            median = statistics.median(values) * (100 if unit == "%" else 1)
            lines.append(f"- {label}, median: {median:.1f}{unit}")
    if log.evaluations:
        last = log.evaluations[-1]
        lines.append(f"- eval loss: {log.evaluations[0]['eval_loss']:.4f} (after step {log.evaluations[0]['step']}) "
                     f"-> {last['eval_loss']:.4f} (after step {last['step']}), {last['eval_samples']} samples")
    if log.updates:
        histogram = ", ".join(f"{k}: {n}" for k, n in staleness_counts(log).items())
        summary = next((e for e in reversed(log.events) if e["kind"] == "async_summary"), None)
        recomputed = f"; recomputed as too stale: {summary['recomputed']}" if summary else ""
        lines.append(f"- asynchronous updates: {len(log.updates)}; by staleness: {histogram}{recomputed}")
    lines += [f"- note: {n}" for n in log.notes]
    lines += ["", *(f"![{p.removesuffix('.png')}]({p})" for p in plots), ""]
    return "\n".join(lines)
