"""Streaming DiLoCo (``--fragments F``, ``--fragment-delay τ``) on gloo ranks run as
threads, through ``DiLoCoProgram.window`` (the call a worker's window is): against the
plain one-process replay of the documented rule (tests.reference.replay_diloco), against
the closed form of local SGD on a constant gradient (every inner step's progress lands in
θ once, whatever F and τ), and with F = 1, τ = 0 as plain DiLoCo."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from elastic_dp import ConfigError, Task, TaskError, TrainConfig
from elastic_dp.modes.diloco.program import DiLoCoProgram, fragments_of
from elastic_dp.modes.diloco.settings import DiLoCoSettings
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.reference import max_abs_diff, replay_diloco
from tests.tasks import TINY_GPT_TASK, Regression
from tests.zero_runs import CPU, initial_weights

TOL = 2e-5  # float32 order; worst measured 8.4e-06 (5 tests here, from 0 by case; 3 suite runs on
# 2026-12-04, python -m tests.noise; thread ranks: the same figure in each run): 2.4x margin, while a
# fragment synced a step off moves it 2.9e-2 or more (the checks below)


def run_windows(task: Task, config: TrainConfig, world: int, settings: DiLoCoSettings, initial, probe=None):
    """``config.steps`` inner steps in windows on ``world`` thread ranks. Returns rank 0's
    final weights, every rank's flat θ after each window, and each window's outer records
    of rank 0. ``probe(program, start)``: called after each window but the last."""
    sampler = {"dataset_len": len(task.dataset()), "global_batch": config.global_batch, "seed": config.seed}

    def rank_fn(group):
        replica = Replica(task, config, CPU, group)
        replica.model.load_state_dict(initial)
        replica.broadcast_state(0)
        program = DiLoCoProgram(replica, settings)
        program.sync_from(0, 0)
        thetas, records = [], []
        for start in range(0, config.steps, settings.sync_every):
            stop = min(start + settings.sync_every, config.steps)
            report = program.window(start, stop, sampler, {})
            thetas.append(torch.cat([t.detach().reshape(-1).clone() for t in program.theta]))
            records.append(report["outer"])
            if probe is not None and stop < config.steps:
                probe(program, stop)
        return replica.model_state(), thetas, records

    results = run_ranks(world, rank_fn)
    return results[0][0], [r[1] for r in results], results[0][2]


def test_the_schedule_and_the_fragments_follow_the_documented_rule():
    settings = DiLoCoSettings(sync_every=6, fragments=3, fragment_delay=1)
    assert settings.schedule() == [(1, 2), (3, 4), (5, 6)]
    assert DiLoCoSettings(sync_every=10, fragments=3).schedule() == [(3, 3), (6, 6), (10, 10)]
    assert DiLoCoSettings(sync_every=4).schedule() == [(4, 4)] and not DiLoCoSettings(sync_every=4).streaming
    # a parameter belongs where its middle element falls: 10 of 40 elements per fragment of 4
    assert fragments_of([4, 4, 12, 10, 10], 4) == [0, 0, 1, 2, 3]
    with pytest.raises(TaskError, match="fragments=3: .* leaves fragment 0 empty"):  # 1, 2, 2
        fragments_of([100, 1, 1], 3)


@pytest.mark.parametrize(("world", "fragments", "delay"), [(3, 1, 0), (3, 1, 2), (3, 3, 0), (3, 3, 1), (2, 3, 1)])
def test_the_windows_follow_the_replay_of_the_streaming_rule(world, fragments, delay):
    """The tiny GPT, inner AdamW (clipping, warmup), H = 6, outer Nesterov (0.7, 0.9), 14
    inner steps of 13 samples (uneven slices; the last window short: 2 steps, then the
    final sync): the replay within 2e-5 (AdamW's float32 order noise over 14 steps, as in
    tests/test_diloco.py), every rank's θ bit for bit the same after every window, and
    the final parameters θ. The bound separates the schedules: the replay of another
    delay, or of plain DiLoCo, is further than it."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=14, global_batch=13, micro_batch=None)
    initial = initial_weights(task, config.seed)
    settings = DiLoCoSettings(sync_every=6, fragments=fragments, fragment_delay=delay)
    ours, thetas, records = run_windows(task, config, world, settings, initial)
    rule = dict(world=world, sync_every=6, outer_lr=0.7, outer_momentum=0.9)
    expected, history = replay_diloco(task, config, initial, **rule, fragments=fragments, delay=delay)
    assert max_abs_diff(ours, initial) > 1e-3
    assert max_abs_diff(ours, expected) < TOL, max_abs_diff(ours, expected)
    for t in range(len(thetas[0])):
        assert all(torch.equal(thetas[r][t], thetas[0][t]) for r in range(world)), t
    # the outer steps: one per fragment and window, then the final sync of those not sent at the last step
    used = [(r["fragment"], r["sent_step"], r["step"]) for window in records for r in window]
    assert len(used) == len(history)
    windows = [(0, 6), (6, 12), (12, 14)]
    plan = settings.schedule()
    scheduled = [(f, start + send, start + use) for start, stop in windows for f, (send, use) in enumerate(plan)
                 if start + send <= stop]
    final = [(f, 14, 14) for f, (send, _) in enumerate(plan) if send != 2]
    assert used == [(f, s, min(u, 14)) for f, s, u in scheduled] + final
    assert max_abs_diff({"theta": thetas[0][-1]}, {"theta": torch.cat([h.reshape(-1) for h in history[-1]])}) < TOL
    if (fragments, delay) != (1, 0):
        plain, _ = replay_diloco(task, config, initial, **rule)
        assert max_abs_diff(plain, expected) > 1e-3
    if delay:
        other, _ = replay_diloco(task, config, initial, **rule, fragments=fragments, delay=delay - 1)
        assert max_abs_diff(other, expected) > 1e-3


class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.zeros(2)) for _ in range(3))


G = torch.tensor([1.0, -2.0])


def _constant_loss(model: nn.Module, batch) -> torch.Tensor:
    x, _ = batch
    return ((model.a + 2 * model.b - model.c) * G).sum() + 0.0 * x.sum()


@pytest.mark.parametrize(("fragments", "delay"), [(1, 0), (1, 3), (3, 0), (3, 1)])
def test_local_sgd_on_a_constant_gradient_keeps_every_inner_step_once(fragments, delay):
    """Local SGD (outer lr 1, no momentum), inner SGD η = 0.1 on gradients (G, 2G, −G),
    H = 6, 15 steps, 2 ranks with slices 3 and 2 of 5: every replica moves by η·g a step,
    so θ ends at −15·η·g whatever F and τ if each inner step's progress lands in θ once. A
    rule that dropped the steps between a send and its use (setting the fragment to θ_f)
    would end at −(15 − kτ)·η·g; one that counted them twice, further."""
    task = Task(model=_Three, dataset=Regression, loss=_constant_loss,
                optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                defaults=TrainConfig(steps=15, global_batch=5, seed=0, clip_grad_norm=None))
    initial = initial_weights(task, 0)
    settings = DiLoCoSettings(sync_every=6, outer_lr=1.0, outer_momentum=0.0, fragments=fragments,
                             fragment_delay=delay)
    ours, _, _ = run_windows(task, task.defaults, 2, settings, initial)
    for name, scale in (("a", 1), ("b", 2), ("c", -1)):
        assert torch.allclose(ours[name], -15 * 0.1 * scale * G, atol=1e-5), (name, ours[name])  # 1.4e-6 measured


def test_between_windows_a_member_keeps_its_own_parameters_and_evaluates_theta():
    """After a window of F = 3, τ = 1 the fragments synced before its end have trained on
    in each member: its parameters differ from θ there, and from the other member's;
    ``at_theta`` puts θ in the model and the member's own back after."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=12, global_batch=13, micro_batch=None)
    initial = initial_weights(task, config.seed)
    seen = {}

    def probe(program, step):
        own = [p.detach().clone() for p in program.params]
        first = program.fragments[0]
        assert max(float((own[i] - program.theta[i].detach()).abs().max()) for i in first) > 1e-4
        last = program.fragments[-1]  # used at the window's end with the steps since its send
        with program.at_theta():
            assert all(torch.equal(p, t) for p, t in zip(program.params, program.theta))
        assert all(torch.equal(p, o) for p, o in zip(program.params, own))
        seen[program.replica.group.rank, step] = torch.cat([own[i].reshape(-1) for i in first + last])

    run_windows(task, config, 2, DiLoCoSettings(sync_every=6, fragments=3, fragment_delay=1), initial, probe)
    assert float((seen[0, 6] - seen[1, 6]).abs().max()) > 1e-4


@pytest.mark.parametrize(("settings", "says"), [
    (dict(mode="diloco", sync_every=4, fragments=5), "--fragments 5 syncs each fragment"),
    (dict(mode="diloco", sync_every=6, fragments=3, fragment_delay=2), "--fragment-delay 2 must be under"),
    (dict(mode="diloco", fragments=0), "fragments must be >= 1"),
    (dict(mode="diloco", fragment_delay=-1), "fragment_delay must be >= 0"),
])
def test_streaming_settings_out_of_range_are_refused_naming_them(settings, says):
    with pytest.raises(ConfigError) as raised:
        TrainConfig(**settings)
    assert says in raised.value.args[0]
