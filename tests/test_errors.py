"""Errors name what the caller used: the flag from ``elastic-dp``, the field from the Python
API, for the same error; the table of names matches the command's flags and the config
classes' fields."""

from __future__ import annotations

import dataclasses
import re

import pytest

from elastic_dp import CheckpointConfig, ClusterConfig, ConfigError, MetricsConfig, TrainConfig, Trainer, cli
from elastic_dp.errors import API_NAMES, SURFACE, WorkerError
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


def test_every_name_in_the_table_is_a_flag_of_the_command_and_a_field_of_the_api():
    train = next(a for a in cli._parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    flags = {s for action in train._actions for s in action.option_strings if s.startswith("--")} - {"--help"}
    assert set(API_NAMES) - flags == set()  # no stale flag
    assert flags - set(API_NAMES) == set()  # every flag of elastic-dp train has its API name
    classes = {"TrainConfig": TrainConfig, "ClusterConfig": ClusterConfig, "CheckpointConfig": CheckpointConfig,
               "MetricsConfig": MetricsConfig}
    for flag, api in API_NAMES.items():
        named = re.match(r"(\w+)(?:\.(\w+)|\((\w+)=|'s (\w+))", api)
        owner, field = named.group(1), next(g for g in named.groups()[1:] if g)
        if owner == "Trainer":
            assert field in Trainer.__init__.__code__.co_varnames, flag
        else:
            assert field in {f.name for f in dataclasses.fields(classes[owner])}, flag
