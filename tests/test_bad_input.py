"""Bad input fails with a clear error naming what to change, and leaves nothing half-written."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from elastic_dp import (
    CheckpointConfig,
    CheckpointError,
    ClusterConfig,
    ConfigError,
    MetricsConfig,
    PlacementError,
    TaskError,
    TrainConfig,
    Trainer,
    cli,
    load_task,
)
from tests.tasks import BAD_LOSS_TASK, MLP_TASK, NO_OPTIMIZER_TASK, NO_PARAMETERS_TASK


def _trainer(task=MLP_TASK, *, workers=2, out=None, **kw):
    train = dataclasses.replace(task.defaults, **kw.pop("train", {}))
    return Trainer(task, train=train, cluster=ClusterConfig(workers=workers, **kw.pop("cluster", {})),
                   checkpoint=CheckpointConfig(**kw.pop("checkpoint", {})),
                   out_dir=str(out) if out else None, progress=False)


def test_unknown_job_module_is_named():
    with pytest.raises(TaskError, match=r"no job module named 'jobs\.nope'.*jobs\.gpt"):
        load_task("jobs.nope")
    with pytest.raises(TaskError, match="has no TASK"):
        load_task("json")


def test_cli_reports_unknown_job_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "elastic_dp.cli", "train", "jobs.nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no job module named 'jobs.nope'" in proc.stderr


@pytest.mark.parametrize("batch", [0, -4])
def test_non_positive_global_batch(batch):
    with pytest.raises(ConfigError, match=r"TrainConfig\.global_batch"):
        TrainConfig(global_batch=batch)


def test_global_batch_smaller_than_worker_count(tmp_path):
    with pytest.raises(ConfigError, match=r"smaller than the 3 workers.*TrainConfig\.global_batch"):
        _trainer(workers=3, train={"global_batch": 2}, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dataset_shorter_than_one_global_batch(ray_cluster, tmp_path):
    with pytest.raises(ConfigError, match="96 samples, fewer than one global batch of 200"):
        _trainer(train={"global_batch": 200}, out=tmp_path / "out").fit()
    assert not (tmp_path / "out").exists()


def test_more_workers_than_the_cluster_can_place(ray_cluster):
    with pytest.raises(PlacementError, match=r"could not place 9 workers .* 4 in all.*ClusterConfig\.workers"):
        _trainer(workers=9, train={"global_batch": 9}, cluster={"placement_timeout_s": 2}).fit()


# Not in the Ray tier: these fail before Ray starts (a test there that started it would fail).
def test_an_out_or_checkpoint_dir_that_cannot_be_a_directory_is_refused_before_anything_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"CheckpointConfig\.dir .*/a-file is a file, not a directory"):
        _trainer(checkpoint={"dir": str(blocker)}).fit()
    with pytest.raises(CheckpointError, match=r"CheckpointConfig\.dir .*/a-file/ckpt is under .*/a-file, which is a "
                                              r"file, not a directory"):
        _trainer(checkpoint={"dir": str(blocker / "ckpt")}).fit()
    with pytest.raises(CheckpointError, match=r"Trainer's out_dir .*/a-file/run is under .*/a-file, which is a file"):
        _trainer(out=blocker / "run").fit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_resume_without_checkpoint_is_refused_before_anything_starts_and_creates_nothing(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint to resume from.*CheckpointConfig\.resume"):
        _trainer(checkpoint={"dir": str(tmp_path / "empty" / "ckpt"), "resume": True}).fit()
    assert not (tmp_path / "empty").exists()
    with pytest.raises(ConfigError, match=r"CheckpointConfig\.dir"):
        CheckpointConfig(resume=True)


@pytest.mark.parametrize("args, says", [
    (["--out", "{blocker}/run"], "--out {blocker}/run is under {blocker}, which is a file, not a directory"),
    (["--checkpoint-dir", "{blocker}", "--checkpoint-every", "1"], "--checkpoint-dir {blocker} is a file"),
    (["--checkpoint-dir", "{empty}", "--resume"], "no checkpoint to resume from in {empty}: drop --resume")])
def test_the_cli_refuses_bad_paths_in_one_line_before_ray_starts(tmp_path, args, says):
    blocker, empty = tmp_path / "a-file", tmp_path / "nothing"
    blocker.write_text("")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "elastic_dp.cli", "train", "jobs.gpt", "--no-progress",
                           *(a.format(blocker=blocker, empty=empty) for a in args)],
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"elastic-dp: error: {says.format(blocker=blocker, empty=empty)}"), proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line, no traceback, nothing of Ray's
    assert not empty.exists()
    assert took < 10, took  # the interpreter and the imports (1.5-2 s here); Ray's start alone takes 4-6 s


def test_the_cli_refuses_a_dataset_smaller_than_one_global_batch_before_ray_starts(tmp_path):
    # jobs.gpt's corpus is 31,249 windows, built in 20 ms: checked on the driver before the
    # embedded Ray starts (DatasetProbe), 2.1 s in all against 9.5 s when the workers found it
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "elastic_dp.cli", "train", "jobs.gpt", "--no-progress",
                           "--global-batch", "40000", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("elastic-dp: error: the dataset has 31249 samples, fewer than one global batch of 40000: "
                           "lower --global-batch or use a larger dataset\n")
    assert not (tmp_path / "out").exists()
    assert took < 10, took  # the interpreter and the imports (1.5-2 s here); Ray's start alone takes 4-6 s


def test_the_driver_s_dataset_probe_waits_a_second_and_leaves_a_failing_factory_to_the_workers():
    from elastic_dp.api import DatasetProbe
    from tests.tasks import Regression

    def slow():
        time.sleep(1.5)
        return Regression()

    train = TrainConfig(global_batch=200)
    probe = DatasetProbe(dataclasses.replace(MLP_TASK, dataset=slow))
    start = time.monotonic()
    probe.check(train, wait_s=0.2)  # not built yet: no verdict, the run goes on to start Ray
    assert time.monotonic() - start < 1.0
    with pytest.raises(ConfigError, match="96 samples, fewer than one global batch of 200"):
        probe.check(train, wait_s=10)  # built while Ray started: refused before any worker
    DatasetProbe(dataclasses.replace(MLP_TASK, dataset=lambda: 1 / 0)).check(train, wait_s=10)  # the workers say it


def test_an_optimizer_factory_that_returns_none_or_a_model_without_parameters_is_named(ray_cluster, tmp_path):
    with pytest.raises(TaskError, match=r"Task\.optimizer returned NoneType, not a torch\.optim\.Optimizer"):
        _trainer(NO_OPTIMIZER_TASK, out=tmp_path / "a").fit()
    with pytest.raises(TaskError, match=r"the model Task\.model built \(NoParameters\) has no parameters"):
        _trainer(NO_PARAMETERS_TASK, out=tmp_path / "b").fit()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_cli_names_an_optimizer_factory_that_returns_none_in_one_line(ray_cluster, tmp_path, capsys):
    # the command in this process, attached to the test's cluster (the workers find it: a
    # task error, after Ray's start, which the other commands of this file pay for)
    assert cli.main(["train", "tests.no_optimizer_job", "--no-progress", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == ["elastic-dp: error: Task.optimizer returned NoneType, not a torch.optim.Optimizer: the factory "
                      "must return the optimizer it builds over model.parameters()"], err[-3000:]
    assert not (tmp_path / "out").exists()


def test_resume_with_another_global_batch_or_from_a_corrupted_checkpoint_is_refused(ray_cluster, tmp_path):
    """One checkpoint, refused twice: resumed with another global batch, then with a flipped
    byte in a file; neither attempt writes anything."""
    ckpt = tmp_path / "ckpt"
    _trainer(workers=1, train={"steps": 2}, checkpoint={"dir": str(ckpt)}).fit()
    with pytest.raises(CheckpointError, match=r"global_batch=10.*TrainConfig\.global_batch=10"):
        _trainer(train={"steps": 4, "global_batch": 12}, checkpoint={"dir": str(ckpt), "resume": True},
                 out=tmp_path / "other-batch").fit()
    assert not (tmp_path / "other-batch").exists()
    model_file = next(ckpt.glob("step-00000002-*")) / "model-00000.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-3] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model-00000\.safetensors does not match its sha256"):
        _trainer(train={"steps": 4}, checkpoint={"dir": str(ckpt), "resume": True}, out=tmp_path / "out").fit()
    assert not (tmp_path / "out").exists()


def test_resume_auto_refuses_a_checkpoint_of_its_name_saved_with_other_settings(ray_cluster, tmp_path):
    storage = str(tmp_path / "storage")

    def trainer(name=None, out=None, **train):
        return Trainer(MLP_TASK, train=dataclasses.replace(MLP_TASK.defaults, **train),
                       cluster=ClusterConfig(workers=1), checkpoint=CheckpointConfig(storage=storage),
                       metrics=MetricsConfig(name=name, ray_metrics=False), out_dir=out, progress=False)

    trainer("shared", steps=2).fit()
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"saved with clip_grad_norm=None, and this run has "
                                              r"clip_grad_norm=1\.0.*another\s+MetricsConfig\.name"):
        trainer("shared", out=str(out), steps=4, clip_grad_norm=1.0).fit()
    assert not out.exists()
    # by default the name follows the settings: the same job with other settings is another run
    assert trainer(steps=2).name != trainer(steps=2, clip_grad_norm=1.0).name
    assert trainer(steps=2).name == trainer(steps=7).name  # --steps is not among them
    with pytest.raises(ConfigError, match=r"either CheckpointConfig\.dir=DIR or CheckpointConfig\.storage=URI"):
        CheckpointConfig(dir="a", storage="b")
    with pytest.raises(ConfigError, match="resume must be never, latest or auto"):
        CheckpointConfig(storage="b", resume="sometimes")


def test_loss_that_is_not_a_scalar(ray_cluster, tmp_path):
    with pytest.raises(TaskError, match=r"loss returned \(4,\), expected a scalar"):
        _trainer(BAD_LOSS_TASK, checkpoint={"dir": str(tmp_path / "ckpt")}, out=tmp_path / "out").fit()
    assert list((tmp_path / "ckpt").iterdir()) == []
    assert not (tmp_path / "out" / "final.safetensors").exists()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # a port that was just free: nothing listens on it
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ray  # the command asks Ray to connect
@pytest.mark.parametrize("how", ["--address", "RAY_ADDRESS"])
def test_a_cluster_that_does_not_answer_is_reported_not_waited_on(how):
    import os
    import time

    address = f"127.0.0.1:{_closed_port()}"
    args = ["--address", address] if how == "--address" else []
    env = dict(os.environ, RAY_ADDRESS=address) if how == "RAY_ADDRESS" else os.environ.copy()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "elastic_dp.cli", "train", "jobs.gpt", *args],
                          capture_output=True, text=True, timeout=120, env=env)
    assert time.monotonic() - start < 30
    assert proc.returncode == 2
    assert f"no Ray cluster answers at {address}" in proc.stderr
    assert "--address or RAY_ADDRESS" in proc.stderr and f"this one came from {how}" in proc.stderr
