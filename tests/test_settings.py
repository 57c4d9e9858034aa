"""Settings are declared once, by the part that reads them (``elastic_dp.settings``): the
command's flags, the API's names in errors, the README's table and the run's identity come
from the declarations, and a setting that no chosen part reads is refused, naming it."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from pathlib import Path

import pytest

from elastic_dp import CheckpointConfig, ClusterConfig, ConfigError, MetricsConfig, TrainConfig, cli
from elastic_dp.config import MODES, run_name, run_settings
from elastic_dp.errors import API_NAMES, SURFACE
from elastic_dp.faults import FaultPlan
from elastic_dp.modes.diloco.settings import DiLoCoSettings
from elastic_dp.settings import _parts, declarations, parts_of
from elastic_dp.state.zero.settings import STAGES
from jobs.gpt import TASK

README = Path(__file__).resolve().parents[1] / "README.md"


def _train_flags() -> set[str]:
    train = cli._parser()._subparsers._group_actions[0].choices["train"]
    return {s for action in train._actions for s in action.option_strings if s.startswith("--")} - {"--help"}


def test_the_flags_the_api_names_and_the_readme_table_come_from_the_same_declarations():
    flags = _train_flags()
    declared = {d.flag for config in cli.CONFIGS for d in declarations(config).values() if d.flag} | {
        d.off for config in cli.CONFIGS for d in declarations(config).values() if d.off}
    trainer_own = {"--workers", "--inject", "--out", "--progress", "--no-progress"}
    assert flags == declared | trainer_own
    assert set(API_NAMES) == flags  # every flag has its name in the API, and no stale one is left
    for flag, api in API_NAMES.items():  # ... and that name is one the API takes
        named = re.match(r"(\w+)(?:\.(\w+)|\((\w+)=|'s (\w+))", api)
        owner, field = named.group(1), next(g for g in named.groups()[1:] if g)
        if owner == "Trainer":
            assert field in cli.Trainer.__init__.__code__.co_varnames, flag
        else:
            config = {c.__name__: c for c in cli.CONFIGS}[owner]
            assert field in declarations(config), flag
    table = README.read_text().split("| flag | meaning |", 1)[1].split("\n\n", 1)[0]
    in_table = {flag for row in table.splitlines()[2:] for flag in re.findall(r"--[a-z][a-z0-9-]*",
                                                                                row.split(" | ", 1)[0])}
    assert flags - in_table == set(), "flags missing from the README's table"
    assert in_table - flags == set(), "flags in the README's table that the command does not have"


@pytest.mark.parametrize("mode", list(MODES))
def test_every_setting_of_a_part_the_run_did_not_choose_is_refused_naming_it(mode):
    """For each mode (and at each ZeRO stage of the sync mode), every declared setting that
    no chosen part reads is refused, naming its field in the API and its flag on the command,
    whatever its value; each one a chosen part reads is taken."""
    stages = list(STAGES) if mode == "sync" else [None]
    for stage in stages:
        chosen = {"mode": mode, **({"zero": stage} if stage is not None else {})}
        base = TrainConfig(**chosen)
        read = {f.name for part in parts_of(base) for f in dataclasses.fields(part)}
        for name, declared in declarations(TrainConfig).items():
            if name in read or name in chosen:
                continue
            with pytest.raises(ConfigError) as refused:
                TrainConfig(**chosen, **{name: _a_value_other_than_the_default(name)})
            flag = declared.flag or declared.off
            assert API_NAMES[flag] in str(refused.value), (name, str(refused.value))
            token = SURFACE.set("cli")
            try:
                assert f"{flag} is read only with" in str(refused.value)
            finally:
                SURFACE.reset(token)


def _a_value_other_than_the_default(name: str):
    values = {"bucket_mb": 5.0, "first_bucket_mb": 1.0, "all_reduce": "flat", "reduce_fp32": False, "snapshot_every": 3,
              "shard_scope": "host", "reshard_after_forward": False, "balance": True, "prefetch": True, "batch_stats": "local",
              "max_staleness": 2, "staleness_lr": "inverse", "ps_shards": 2, "ps_device": "cpu", "sync_every": 10,
              "outer_lr": 1.0, "outer_momentum": 0.5, "outer_nesterov": False, "outer_reduce": "bf16",
              "fragments": 2, "fragment_delay": 1, "zero": 1, "spare_copy_every": 3,
              "compress": "powersgd:rank=2", "param_dtype": "bf16", "keep_fp32": "*ln*",
              "compress_scope": "hosts"}
    return values[name]  # a KeyError: a new part's setting needs a value here


def test_the_three_holes_of_the_old_checks_are_closed_from_the_command_line(capsys):
    """--mode diloco with the buckets' flags, --snapshot-every at --zero 0: refused before
    any Ray starts (exit 2), naming the flag."""
    for argv, flag in ((["--mode", "diloco", "--bucket-mb", "5"], "--bucket-mb"),
                       (["--mode", "diloco", "--first-bucket-mb", "1"], "--first-bucket-mb"),
                       (["--mode", "diloco", "--no-reduce-fp32"], "--no-reduce-fp32"),
                       (["--snapshot-every", "3"], "--snapshot-every"),
                       (["--zero", "0", "--snapshot-every", "3"], "--snapshot-every"),
                       (["--shard-scope", "host"], "--shard-scope"),
                       (["--zero", "2", "--no-reshard-after-forward"], "--no-reshard-after-forward"),
                       (["--zero", "2", "--spare-copy-every", "3"], "--spare-copy-every"),
                       (["--mode", "diloco", "--spare-copy-every", "3"], "--spare-copy-every")):
        assert cli.main(["train", "jobs.gpt", "--no-progress", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert f"elastic-dp: error: {flag} is read only with" in err and "TrainConfig" not in err, err


def test_a_job_whose_defaults_set_another_mode_s_settings_runs_in_any_mode(monkeypatch):
    """The old refusal compared a field with its dataclass default, so a job whose defaults
    set ``bucket_mb`` could never run with ``--mode async``: now the sync part, with its
    buckets, is not carried into another mode; the same mode keeps the job's settings."""
    job = types.ModuleType("tests_job_with_buckets")
    job.TASK = dataclasses.replace(TASK, defaults=TrainConfig(steps=4, bucket_mb=3.0, zero=2, snapshot_every=2))
    monkeypatch.setitem(sys.modules, job.__name__, job)
    args = cli._parser().parse_args(["train", job.__name__, "--mode", "async", "--max-staleness", "1"])
    train = dataclasses.replace(job.TASK.defaults, **cli._given(args, TrainConfig))
    assert train.mode.name == "async" and train.mode.max_staleness == 1 and train.steps == 4
    args = cli._parser().parse_args(["train", job.__name__, "--mode", "diloco", "--sync-every", "2"])
    assert dataclasses.replace(job.TASK.defaults, **cli._given(args, TrainConfig)).mode == DiLoCoSettings(sync_every=2)
    same = dataclasses.replace(job.TASK.defaults, **cli._given(cli._parser().parse_args(
        ["train", job.__name__, "--zero", "2", "--first-bucket-mb", "1"]), TrainConfig))
    assert (same.buckets.bucket_mb, same.buckets.first_bucket_mb, same.mode.zero.snapshot_every) == (3.0, 1.0, 2)
    other_stage = dataclasses.replace(job.TASK.defaults, zero=3)  # a new stage starts from its own defaults
    assert other_stage.mode.zero.snapshot_every == 1 and other_stage.buckets.bucket_mb == 3.0


def test_a_part_can_be_given_whole_and_is_then_changed_by_name():
    config = TrainConfig(steps=8, mode=DiLoCoSettings(sync_every=4, outer_lr=1.0))
    assert config.mode.sync_every == 4 and config.mode.outer_lr == 1.0
    assert dataclasses.replace(config, fragments=2).mode == DiLoCoSettings(sync_every=4, outer_lr=1.0, fragments=2)
    assert TrainConfig(mode=DiLoCoSettings(sync_every=4), outer_lr=0.5).mode.outer_lr == 0.5
    with pytest.raises(ConfigError, match=r"TrainConfig has no setting 'zero_stage'"):
        TrainConfig(zero_stage=2)
    with pytest.raises(ConfigError, match=r"mode must be one of sync, async, diloco, got 'hogwild' \(TrainConfig\.mode\)"):
        TrainConfig(mode="hogwild")
    with pytest.raises(ConfigError, match=r"zero must be one of 0, 1, 2, 3, got 4 \(TrainConfig\.zero\)"):
        TrainConfig(zero=4)


@pytest.mark.parametrize("settings, says", [
    ({"mode": "async", "max_staleness": -1}, r"TrainConfig\.max_staleness"),
    ({"mode": "async", "ps_shards": 0}, r"TrainConfig\.ps_shards"),
    ({"mode": "async", "staleness_lr": "sqrt"}, r"TrainConfig\.staleness_lr"),
    ({"mode": "async", "eval_every": 2}, r"TrainConfig\.eval_every evaluates between synchronous steps"),
    ({"mode": "diloco", "sync_every": 4, "fragments": 5}, r"TrainConfig\.fragments=5 syncs each fragment"),
    ({"mode": "diloco", "sync_every": 6, "fragments": 2, "fragment_delay": 3},
     r"must be under the inner steps between two fragments' syncs, TrainConfig\.sync_every=6 // "
     r"TrainConfig\.fragments=2 = 3"),
    ({"zero": 1, "snapshot_every": 0}, r"snapshot_every must be >= 1, got 0 \(TrainConfig\.snapshot_every\)"),
    ({"spare_copy_every": -1}, r"spare_copy_every must be >= 0, got -1 \(TrainConfig\.spare_copy_every\)"),
    ({"bucket_mb": 0}, r"\(TrainConfig\.bucket_mb\)"),
])
def test_each_part_checks_its_own_settings_naming_them(settings, says):
    with pytest.raises(ConfigError, match=says):
        TrainConfig(**settings)


def test_the_async_mode_refuses_the_collective_group_s_settings():
    from elastic_dp.modes.context import ModeContext
    from elastic_dp.modes.registry import make_mode
    from elastic_dp.observe.metrics import RunRecorder

    def mode(train, cluster=ClusterConfig()):
        return make_mode(ModeContext(train=train, cluster=cluster, faults=FaultPlan(),
                                     recorder=RunRecorder(None, total_steps=train.steps, progress=False)))

    for cluster, field in ((ClusterConfig(backend="gloo"), "backend"),
                           (ClusterConfig(collective_timeout_s=10.0), "collective_timeout_s")):
        with pytest.raises(ConfigError, match=rf"ClusterConfig\.{field} is a setting of the collective group, and "
                                              r"TrainConfig\.mode='async' has none"):
            mode(TrainConfig(mode="async"), cluster)
    accepted = mode(TrainConfig(mode="async", max_staleness=2, ps_shards=3))
    accepted.close()  # the shard actors it started, where the suite's Ray is up
    assert mode(TrainConfig(bucket_mb=4.0), ClusterConfig(backend="gloo")).generation == -1


def test_the_run_s_identity_is_the_declared_settings_and_names_runs_as_before():
    """The default ``--run-name`` of a run of an earlier version is unchanged (a resubmitted
    job finds its checkpoints): the names below were computed by the hand-written
    ``run_settings`` this replaced, for the same configurations."""
    job = "jobs.gpt:build_model"
    for settings, name in (({}, "gpt-e6fcd0b4"), ({"lr_schedule": "cosine", "warmup_steps": 3}, "gpt-9592d8d1"),
                           ({"lr_schedule": "wsd", "decay_fraction": 0.2, "batch_stats": "global",
                             "micro_batch": None}, "gpt-f5cc284c"),
                           ({"zero": 2, "bucket_mb": 5}, "gpt-e6fcd0b4")):
        assert run_name(run_settings(job, dataclasses.replace(TASK.defaults, **settings))) == name, settings
    identity = run_settings(job, TASK.defaults)
    assert set(identity) == {"job", "global_batch", "seed", "warmup_steps", "lr_reference_batch", "clip_grad_norm",
                             "precision"}
    # the mode, the stage, the steps and the micro-batch do not make another run; the seed does
    assert run_settings(job, dataclasses.replace(TASK.defaults, mode="diloco", steps=7, micro_batch=None)) == identity
    assert run_settings(job, dataclasses.replace(TASK.defaults, seed=1)) != identity


def test_cluster_checkpoint_and_metrics_settings_from_the_command_line_reach_their_configs():
    args = cli._parser().parse_args(["train", "jobs.gpt", "--backend", "gloo", "--leave-grace", "7",
                                     "--checkpoint-dir", "d", "--resume", "--sync-checkpoints", "--run-name", "r",
                                     "--no-ray-metrics", "--peak-tflops", "9"])
    assert ClusterConfig(**cli._given(args, ClusterConfig)) == ClusterConfig(backend="gloo", leave_grace_s=7.0)
    assert CheckpointConfig(**cli._given(args, CheckpointConfig)) == CheckpointConfig(dir="d", resume="latest",
                                                                                      asynchronous=False)
    assert MetricsConfig(**cli._given(args, MetricsConfig)) == MetricsConfig(name="r", ray_metrics=False,
                                                                             peak_tflops=9.0)
    assert cli._given(cli._parser().parse_args(["train", "jobs.gpt"]), ClusterConfig) == {}


def test_every_part_class_is_reachable_from_the_run_s_configuration():
    """A part registered nowhere would never be chosen: each mode and stage is in the tree."""
    reached = {cls for _, cls in _parts(TrainConfig)}
    assert set(MODES.values()) <= reached and set(STAGES.values()) <= reached
