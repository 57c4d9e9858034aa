"""Errors name what the caller used: the flag from ``elastic-dp``, the field from the Python
API, for the same error (the table of names: ``tests/test_settings.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_dp import ClusterConfig, ConfigError, Trainer, cli
from elastic_dp.errors import SURFACE, WorkerError
from jobs.gpt import TASK


def test_one_error_names_the_flag_on_the_command_line_and_the_field_in_python():
    error = ConfigError("--zero 1 shards the optimizer state: run with --zero 0, or lower MIN in --workers MIN:MAX")
    assert str(error) == ("TrainConfig.zero=1 shards the optimizer state: run with TrainConfig.zero=0, or lower MIN "
                          "in ClusterConfig(min_workers=MIN, workers=MAX)")
    token = SURFACE.set("cli")
    try:
        assert str(error) == "--zero 1 shards the optimizer state: run with --zero 0, or lower MIN in --workers MIN:MAX"
    finally:
        SURFACE.reset(token)
    rebuilt = WorkerError("--on-nonfinite fail", rank=1, step=3).__reduce__()
    assert rebuilt[1][1] == "--on-nonfinite fail"  # what crosses between processes is the message as written


def test_the_command_shows_flags_and_the_api_shows_fields_for_the_same_input(capsys):
    assert cli.main(["train", "jobs.gpt", "--workers", "4", "--global-batch", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--global-batch" in err and "TrainConfig" not in err
    with pytest.raises(ConfigError, match=r"TrainConfig\.global_batch") as raised:
        Trainer(TASK, train=dataclasses.replace(TASK.defaults, global_batch=2), cluster=ClusterConfig(workers=4))
    assert "--global-batch" not in str(raised.value)
