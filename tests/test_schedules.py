"""Learning-rate schedules: the stated rules (README, "The replay contract") written out
here independently, each against runs on gloo ranks run as threads (no Ray) and a plain
PyTorch replay that applies the rule; a torch scheduler across a change of world size
through a training state, against a plain loop that steps it; and the refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import save_file

from elastic_dp import ConfigError, TaskError, TrainConfig, Trainer
from elastic_dp.cli import _parser
from elastic_dp.schedules import SchedulerRates
from tests.reference import max_abs_diff, replay
from tests.tasks import MLP_TASK, SCHEDULED_TASK, halving, mlp, sgd_two_groups, warmup_then_exponential
from tests.zero_runs import initial_weights, train

TOL = 2e-5  # SGD on the MLP: float32 reduction order only (as in test_sync_equivalence)
# worst measured 3.3e-08 (5 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 606x margin


def stated(schedule: str, s: int, W: int, D: int, m: float, f: float) -> float:
    """The README's rules, as written there."""
    if s < W:
        return (s + 1) / W
    if schedule == "constant":
        return 1.0
    if s >= D:
        return m
    if schedule == "cosine":
        return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * (s - W) / (D - W)))
    if schedule == "linear":
        return m + (1 - m) * (1 - (s - W) / (D - W))
    S = max(W, D - round(f * D))  # wsd: stable until the last f of the D steps
    return 1.0 if s < S else m + (1 - m) * (1 - (s - S) / (D - S))


def test_the_factors_are_the_stated_rules_at_their_corners():
    config = dict(steps=10, warmup_steps=2, min_lr_ratio=0.1)
    cosine = TrainConfig(lr_schedule="cosine", **config)
    assert [cosine.lr_factor(s) for s in (0, 1, 2, 6, 10, 50)] == pytest.approx([0.5, 1, 1, 0.55, 0.1, 0.1])
    linear = TrainConfig(lr_schedule="linear", decay_steps=6, **config)
    assert [linear.lr_factor(s) for s in (2, 3, 4, 6)] == pytest.approx([1, 0.775, 0.55, 0.1])
    wsd = TrainConfig(lr_schedule="wsd", decay_fraction=0.2, **config)
    assert [wsd.lr_factor(s) for s in (2, 7, 8, 9, 10)] == pytest.approx([1, 1, 1, 0.55, 0.1])
    scaled = TrainConfig(lr_schedule="constant", global_batch=64, lr_reference_batch=32, **config)
    assert [scaled.lr_factor(s) for s in (0, 5, 50)] == pytest.approx([1, 2, 2])
    for name in ("constant", "cosine", "linear", "wsd"):
        c = TrainConfig(lr_schedule=name, steps=40, warmup_steps=5, decay_steps=30, min_lr_ratio=0.2,
                        decay_fraction=0.3)
        assert [c.lr_factor(s) for s in range(45)] == pytest.approx([stated(name, s, 5, 30, 0.2, 0.3)
                                                                     for s in range(45)], abs=1e-12)


@pytest.mark.parametrize("schedule,zero", [("cosine", 0), ("linear", 2), ("wsd", 1)])
def test_a_scheduled_run_on_thread_ranks_ends_on_the_replay_of_the_stated_rule(tmp_path, schedule, zero):
    config = dataclasses.replace(MLP_TASK.defaults, steps=8, warmup_steps=2, lr_schedule=schedule, decay_steps=7,
                                 min_lr_ratio=0.05, decay_fraction=0.5, zero=zero)
    initial = initial_weights(MLP_TASK, config.seed)
    save_file(initial, str(tmp_path / "initial.safetensors"))
    final, _, replicas = train(MLP_TASK, config, 2, range(8), initial)
    expected = replay(MLP_TASK, config, str(tmp_path / "initial.safetensors"),
                      lr_factor=lambda s: stated(schedule, s, 2, 7, 0.05, 0.5))
    assert max_abs_diff(final, expected) < TOL
    unscheduled = replay(MLP_TASK, dataclasses.replace(config, lr_schedule="constant"),
                         str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(expected, unscheduled) > 100 * TOL, "the schedule must have changed the run"
    # the rate of the last step, in each group: the base times the rule
    assert [g["lr"] for g in replicas[0].strategy.param_groups] == pytest.approx(
        [0.05 * stated(schedule, 7, 2, 7, 0.05, 0.5), 0.1 * stated(schedule, 7, 2, 7, 0.05, 0.5)])


def test_the_tasks_own_factor_is_used_instead(tmp_path):
    task = dataclasses.replace(MLP_TASK, lr_schedule=halving)
    config = dataclasses.replace(MLP_TASK.defaults, steps=7)
    initial = initial_weights(task, config.seed)
    save_file(initial, str(tmp_path / "initial.safetensors"))
    final, _, _ = train(task, config, 3, range(7), initial)
    expected = replay(task, config, str(tmp_path / "initial.safetensors"), lr_factor=lambda s: 0.5 ** (s // 3))
    assert max_abs_diff(final, expected) < TOL


def test_a_torch_scheduler_carried_in_the_training_state_to_another_world_size_ends_on_the_plain_loop(tmp_path):
    """Steps 0-3 on 2 ranks; their training state (the scheduler's among it) starts 3 ranks
    on steps 4-9; a plain loop steps the scheduler after each of 10 steps."""
    task, config = SCHEDULED_TASK, dataclasses.replace(MLP_TASK.defaults, steps=10)
    initial = initial_weights(task, config.seed)
    save_file(initial, str(tmp_path / "initial.safetensors"))
    _, states, _ = train(task, config, 2, range(4), initial)
    assert states[0].optimizer_meta["scheduler"]["last_epoch"] == 4
    final, _, replicas = train(task, config, 3, range(4, 10), None, start=states[0])
    expected = replay(task, config, str(tmp_path / "initial.safetensors"), scheduler=warmup_then_exponential)
    assert max_abs_diff(final, expected) < TOL
    model = mlp()
    loop = warmup_then_exponential(optimizer := sgd_two_groups(model))
    for _ in range(9):
        optimizer.step()
        loop.step()
    assert [g["lr"] for g in replicas[0].strategy.param_groups] == pytest.approx(
        [g["lr"] for g in optimizer.param_groups])


def test_scheduler_rates_are_a_function_of_the_step():
    """Asked again for earlier steps (a re-run, a rollback) or after a load, the rates are
    those of a scheduler stepped once per step."""
    model = mlp()
    optimizer = sgd_two_groups(model)
    rates = SchedulerRates(warmup_then_exponential, optimizer)
    loop = warmup_then_exponential(plain := sgd_two_groups(mlp()))
    expected = []
    for _ in range(12):
        expected.append([g["lr"] for g in plain.param_groups])
        plain.step()
        loop.step()
    assert [rates.at(s) for s in range(12)] == [pytest.approx(e) for e in expected]
    assert rates.at(5) == pytest.approx(expected[5]) and rates.at(0) == pytest.approx(expected[0])
    state = rates.state(7)
    assert state["last_epoch"] == 7
    other = SchedulerRates(warmup_then_exponential, optimizer)
    other.load(state, 7)
    assert [other.at(s) for s in range(7, 12)] == [pytest.approx(e) for e in expected[7:]]
    assert other.at(2) == pytest.approx(expected[2])  # before its origin: from a new scheduler
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.1]  # the real optimizer is never touched


def test_a_scheduler_that_sets_more_than_the_rate_or_steps_on_a_metric_is_refused():
    optimizer = sgd_two_groups(mlp())
    with pytest.raises(TaskError, match=r"Task.scheduler changed 'momentum' of param group 0 at step 0.*cycle_momentum=False"):
        SchedulerRates(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10), optimizer)
    with pytest.raises(TaskError, match="ReduceLROnPlateau"):
        SchedulerRates(lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o), optimizer)
    with pytest.raises(TaskError, match="expected a torch.optim.lr_scheduler.LRScheduler"):
        SchedulerRates(lambda o: None, optimizer)


def test_bad_schedule_settings_name_the_setting():
    with pytest.raises(ConfigError, match=r"lr_schedule must be one of constant, cosine, linear, wsd, got 'step' \(TrainConfig.lr_schedule\)"):
        TrainConfig(lr_schedule="step")
    with pytest.raises(ConfigError, match=r"TrainConfig.lr_schedule='cosine' decays after the warmup.*but that is 10, not after TrainConfig.warmup_steps=10"):
        TrainConfig(lr_schedule="cosine", steps=20, warmup_steps=10, decay_steps=10)
    with pytest.raises(ConfigError, match=r"min_lr_ratio must be in \[0, 1\]"):
        TrainConfig(min_lr_ratio=1.5)
    with pytest.raises(ConfigError, match=r"decay_fraction must be in \(0, 1\]"):
        TrainConfig(decay_fraction=0)
    with pytest.raises(ConfigError, match="TrainConfig.lr_schedule='cosine'"):
        Trainer(dataclasses.replace(MLP_TASK, lr_schedule=halving),
                train=dataclasses.replace(MLP_TASK.defaults, lr_schedule="cosine"))
    with pytest.raises(ConfigError, match="both Task.lr_schedule and Task.scheduler"):
        Trainer(dataclasses.replace(SCHEDULED_TASK, lr_schedule=halving))
    with pytest.raises(ConfigError, match=r"Task.scheduler .* TrainConfig.mode='async' .*Task.lr_schedule"):
        Trainer(SCHEDULED_TASK, train=dataclasses.replace(MLP_TASK.defaults, mode="async"))


def test_a_tasks_factor_that_is_not_a_number_is_refused_naming_the_step(tmp_path):
    task = dataclasses.replace(MLP_TASK, lr_schedule=lambda s: float("nan") if s == 2 else 1.0)
    config = dataclasses.replace(MLP_TASK.defaults, steps=4)
    with pytest.raises(TaskError, match=r"Task.lr_schedule\(2\) returned nan"):
        train(task, config, 1, range(4), initial_weights(task, config.seed))


def test_the_schedule_flags_reach_the_configuration():
    args = _parser().parse_args(["train", "jobs.gpt", "--lr-schedule", "wsd", "--warmup-steps", "5",
                                 "--decay-steps", "90", "--min-lr-ratio", "0", "--decay-fraction", "0.2"])
    assert (args.lr_schedule, args.warmup_steps, args.decay_steps, args.min_lr_ratio, args.decay_fraction) == (
        "wsd", 5, 90, 0.0, 0.2)
