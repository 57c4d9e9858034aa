"""What a run shows people: ``elastic-dp report`` plots and report.md, TensorBoard scalars,
throughput and model FLOPs utilisation. One run with a kill and a join feeds the first
two; the markers are checked in the plotted data (the figure's lines), not in the
pixels, and the TensorBoard files are read back with TensorBoard's own reader."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from elastic_dp import ClusterConfig, ConfigError, MetricsConfig, Trainer
from elastic_dp.observe.metrics import Throughput, known_peak_tflops
from elastic_dp.observe.report import (
    ReportError,
    RunLog,
    plot_breakdown,
    plot_loss,
    pauses,
    plot_lr,
    plot_throughput,
    read_run,
    write_report,
)
from tests.records import read_lines
from tests.tasks import MLP_TASK

ROOT = Path(__file__).resolve().parents[1]
REPORT_SEED = 1103


@pytest.fixture(scope="module")
def run_dir(ray_cluster, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    # a seed of its own: its default run name (the metrics' run tag) is no other test's
    config = dataclasses.replace(MLP_TASK.defaults, steps=8, seed=REPORT_SEED)
    Trainer(MLP_TASK, train=config, cluster=ClusterConfig(workers=3, min_workers=1), out_dir=str(out),
            progress=False, inject=["kill:step=2:rank=1", "join:step=5"],
            metrics=MetricsConfig(tensorboard=str(out / "tb"))).fit()
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return read_lines(run_dir / "metrics.jsonl")


def _events(run_dir: Path) -> list[dict]:
    return read_lines(run_dir / "events.jsonl")


def test_report_draws_every_plot_and_marks_each_change_at_its_step(run_dir, tmp_path):
    out = write_report(run_dir, tmp_path / "report")
    for name in ("loss.png", "throughput.png", "breakdown.png", "lr.png"):
        with Image.open(out / name) as image:
            image.verify()
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.size == (800, 450)
    changes = [e for e in _events(run_dir) if e["kind"] == "membership_changed"]
    kill = next(e for e in changes if e["lost"])
    assert kill["step"] == 2  # rank 1 died in step 2; the next generation trained step 2 again
    assert any(e["step"] == 5 and e["joined"] for e in changes)  # join:step=5
    fig = plot_loss(read_run(run_dir))
    marked = [line.get_xdata()[0] for line in fig.axes[0].lines if line.get_gid() == "change"]
    assert sorted(marked) == sorted(e["step"] for e in changes)
    loss_line = fig.axes[0].lines[0]
    assert list(loss_line.get_xdata()) == list(range(8))
    report = (out / "report.md").read_text()
    assert "![loss](loss.png)" in report and "workers lost: 1" in report and "steps: 8" in report


def test_a_truncated_last_line_is_left_out_and_said(run_dir, tmp_path):
    copy = tmp_path / "copied"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report"))
    text = (copy / "metrics.jsonl").read_text()
    (copy / "metrics.jsonl").write_text(text[:-20])  # the last line cut mid-way, as by a crash
    log = read_run(copy)
    assert [m["step"] for m in log.metrics] == list(range(7))
    out = write_report(copy)
    assert "metrics.jsonl: the last line is truncated" in (out / "report.md").read_text()


def test_a_directory_without_metrics_is_refused_naming_it(tmp_path):
    with pytest.raises(ReportError, match=r"has no metrics.jsonl: pass the directory a run wrote with Trainer's\ out_dir"):
        read_run(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "elastic_dp.cli", "report", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{tmp_path} has no metrics.jsonl" in proc.stderr
    assert not (tmp_path / "report").exists()


def test_tensorboard_scalars_read_back_with_tensorboards_reader(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tb"))
    board.Reload()
    metrics = _metrics(run_dir)
    last = {m["step"]: m for m in metrics}  # a re-run step is written twice; its last value counts
    loss = board.Scalars("train/loss")
    assert sorted({e.step for e in loss}) == sorted(last)
    # TensorBoard keeps float32: a loss below 8 rounds by at most 2^-24 x 8 = 4.8e-7
    assert all(abs(e.value - last[e.step]["loss"]) < 1e-6 for e in loss if e.wall_time == last[e.step]["time"])
    sizes = {e.step: e.value for e in board.Scalars("cluster/world_size")}
    assert all(sizes[s] == m["world_size"] for s, m in last.items())
    for tag in ("train/lr", "throughput/samples_per_s", "time/step_s", "time/compute_s", "time/other_s"):
        assert len(board.Scalars(tag)) >= 8, tag
    changes = [e for e in _events(run_dir) if e["kind"] == "membership_changed"]
    marks = board.Scalars("cluster/membership_changes")
    assert [e.step for e in marks] == [e["step"] for e in changes] and marks[-1].value == len(changes)
    assert "tokens_per_s" not in metrics[0]  # the task declares no tokens per sample


def test_the_breakdown_stacks_each_phase_and_the_rest_of_the_step_as_other():
    metrics = [{"step": 0, "time": 10.0, "step_s": 1.0, "compute_s": 0.5, "parameter_wait_s": 0.1,
                "reduce_wait_s": 0.1, "optimizer_s": 0.05, "snapshot_s": 0.05, "other_s": 0.2},
               {"step": 1, "time": 11.0, "step_s": 1.0, "compute_s": 0.6, "parameter_wait_s": 0.0,
                "reduce_wait_s": 0.1, "optimizer_s": 0.05, "snapshot_s": 0.05, "other_s": 0.2}]
    axes = plot_breakdown(RunLog(metrics=metrics, events=[])).axes[0]
    heights = {label: [bar.get_height() for bar in container]
               for label, container in zip([t.get_text() for t in axes.get_legend().get_texts()], axes.containers)}
    assert list(heights) == ["compute", "parameter wait", "reduce wait", "optimizer", "snapshot", "other"]
    assert heights["parameter wait"] == pytest.approx([0.1, 0.0])
    assert heights["other"] == pytest.approx([0.2, 0.2])  # what the timed phases leave of the step


def test_the_learning_rate_is_plotted_at_each_step_a_skipped_one_left_out():
    metrics = [{"step": s, "time": 10.0 + s, "step_s": 1.0, "lr": lr} for s, lr in enumerate([0.1, 0.05, None, 0.02])]
    line = next(line for line in plot_lr(RunLog(metrics=metrics, events=[])).axes[0].lines if line.get_gid() == "lr")
    assert list(line.get_xdata()) == [0, 1, 3] and list(line.get_ydata()) == [0.1, 0.05, 0.02]


def test_a_pause_between_steps_is_drawn_as_a_gap_not_as_a_slope():
    """8 s waiting for a joiner between steps 2 and 3 of 0.5 s steps: the line breaks there and
    the pause is shaded; steps back to back are one line."""
    ends = [10.0, 10.5, 11.0, 19.5, 20.0]
    metrics = [{"step": s, "time": t, "step_s": 0.5, "samples": 32, "world_size": 2 if s < 3 else 3}
               for s, t in enumerate(ends)]
    assert pauses(metrics) == [(11.0, 19.0)]
    axes = plot_throughput(RunLog(metrics=metrics, events=[])).axes[0]
    line = next(line for line in axes.lines if line.get_gid() == "samples_per_s")
    rates = list(line.get_ydata())
    assert [r != r for r in rates] == [False, False, False, True, False, False]  # one NaN: the break after step 2
    span, = [p for p in axes.patches if p.get_gid() == "pause"]
    assert span.get_x() == pytest.approx(11.0 - 9.5) and span.get_width() == pytest.approx(8.0)
    assert pauses(metrics[:3]) == []


def test_throughput_tokens_and_model_flops_utilisation():
    figures = Throughput(tokens_per_sample=64, flops_per_sample=3e8, peak_flops=1e12).figures(32, 0.5, 2)
    assert figures == {"samples_per_s": 64.0, "tokens_per_s": 4096.0, "mfu": 64 * 3e8 / (2 * 1e12)}
    assert Throughput().figures(32, 0.5, 2) == {"samples_per_s": 64.0}  # no tokens, FLOPs or peak declared
    assert known_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and known_peak_tflops("") is None
    from jobs.gpt import CONTEXT, GPT, TASK
    params = sum(p.numel() for p in GPT().parameters())
    assert TASK.tokens_per_sample == CONTEXT and TASK.flops_per_sample >= 6 * params * CONTEXT


def test_an_unwritable_tensorboard_path_is_refused_before_anything_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"TensorBoard directory .* cannot be written.*MetricsConfig\.tensorboard"):
        Trainer(MLP_TASK, cluster=ClusterConfig(workers=2), out_dir=str(tmp_path / "out"), progress=False,
                metrics=MetricsConfig(tensorboard=str(blocker / "tb"))).fit()
    assert not (tmp_path / "out").exists()


def _scrape(ray_cluster, run: str, ready, timeout_s: float = 40.0) -> dict[str, float]:
    """The ``ray_elastic_dp_*`` samples tagged ``run=<run>`` on this node's metrics endpoint."""
    import re
    import time
    import urllib.request

    port = next(n["MetricsExportPort"] for n in ray_cluster.nodes() if n["Alive"])
    deadline = time.monotonic() + timeout_s
    while True:  # the agent exports every few seconds
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        found = {}
        for line in text.splitlines():
            m = re.match(r'ray_(elastic_dp_\w+)\{(.*)\} (\S+)$', line)
            if m and f'run="{run}"' in m.group(2):
                found[m.group(1)] = float(m.group(3))
        if ready(found) or time.monotonic() > deadline:
            return found
        time.sleep(1)


def test_the_runs_figures_are_ray_metrics_that_prometheus_scrapes(ray_cluster, run_dir):
    metrics, events = _metrics(run_dir), _events(run_dir)
    # the run tag defaults to the run's name (the job and a hash of its settings); wait for an
    # export after the last step
    name = Trainer(MLP_TASK, train=dataclasses.replace(MLP_TASK.defaults, steps=8, seed=REPORT_SEED)).name
    assert name.startswith("tasks-")
    found = _scrape(ray_cluster, name, lambda f: f.get("elastic_dp_steps_total") == len(metrics))
    assert found["elastic_dp_world_size"] == metrics[-1]["world_size"]
    assert found["elastic_dp_loss"] == pytest.approx(metrics[-1]["loss"])
    assert found["elastic_dp_steps_total"] == len(metrics)
    changes = [e for e in events if e["kind"] == "membership_changed"]
    assert found["elastic_dp_reformations_total"] == len(changes)
    assert found["elastic_dp_failures_total"] == sum(1 for e in changes if e["lost"]) == 1
    assert found.get("elastic_dp_restores_total", 0.0) == 0.0
