"""DiLoCo's worker side (``elastic_dp.modes.diloco.program``) on gloo ranks run as threads,
against its oracles: with H = 1, inner SGD and outer SGD of rate 1 without momentum it
is synchronous data parallelism; on one replica with outer rate 1 and no momentum it is
plain training; a constant gradient gives the closed form of the outer Nesterov update;
and at 2 and 3 replicas (uneven slices), H = 4, inner AdamW and outer Nesterov it follows
the plain one-process replay of the contract (tests.reference.replay_diloco), every
replica holding the same θ after every outer step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from elastic_dp import ElasticSampler, Task, TrainConfig
from elastic_dp.data import split
from elastic_dp.modes.diloco.program import DiLoCoProgram
from elastic_dp.modes.diloco.settings import DiLoCoSettings
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.reference import max_abs_diff, replay, replay_diloco
from tests.tasks import MLP_TASK, TINY_GPT_TASK, Regression
from tests.zero_runs import CPU, initial_weights

TOL = 2e-5  # float32 order; worst measured 2.6e-06 (the tests here, 3 suite runs on 2026-12-04,
# python -m tests.noise; thread ranks: the same figure in each run): 8x margin


def run(task: Task, config: TrainConfig, world: int, settings: DiLoCoSettings, initial):
    """``config.steps`` inner steps on ``world`` thread ranks; rank 0's final weights and
    every rank's flat θ after each outer step."""
    dataset_len = len(task.dataset())
    sampler = ElasticSampler(dataset_len, global_batch=config.global_batch, seed=config.seed)

    def rank_fn(group):
        replica = Replica(task, config, CPU, group)
        replica.model.load_state_dict(initial)
        replica.broadcast_state(0)
        program = DiLoCoProgram(replica, settings)
        program.start()
        thetas = []
        for start in range(0, config.steps, settings.sync_every):
            samples = 0
            for step in range(start, min(start + settings.sync_every, config.steps)):
                mine = split(sampler.batch(step), group.world_size)[group.rank]
                assert program.inner_step(step, mine).committed
                samples = len(mine)
            program.outer_step(samples, config.global_batch)
            thetas.append(torch.cat([t.detach().reshape(-1).clone() for t in program.theta]))
        return replica.model_state(), thetas

    results = run_ranks(world, rank_fn)
    return results[0][0], [r[1] for r in results]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_one_inner_step_of_plain_sgd_and_an_outer_rate_of_1_is_synchronous_data_parallelism(tmp_path):
    """θ_k = θ − η g_k, so θ − Σ n_k/B θ_k = η Σ n_k/B g_k: the sync step's update. 3 ranks,
    slices of 4, 3 and 3 of 10 (the per-replica means weighted by their samples), 8 steps;
    within float32 order noise (1e-6)."""
    task = dataclasses.replace(MLP_TASK, optimizer=_sgd)
    config = dataclasses.replace(task.defaults, steps=8, micro_batch=None)
    initial = initial_weights(task, config.seed)
    ours, _ = run(task, config, 3, DiLoCoSettings(sync_every=1, outer_lr=1.0, outer_momentum=0.0), initial)
    save_file(initial, tmp_path / "initial.safetensors")
    sync = replay(task, config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(ours, initial) > 1e-3
    assert max_abs_diff(ours, sync) < 1e-6  # measured 8.9e-8 (thread ranks, 3 runs): 11x


def test_one_replica_with_an_outer_rate_of_1_and_no_momentum_is_plain_training(tmp_path):
    """The tiny GPT, inner AdamW with clipping and warmup, H = 4 over 10 steps (the last
    outer step syncs 2): the plain loop's parameters (AdamW's 2e-5 bound over 10 steps)."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=10, micro_batch=None)
    initial = initial_weights(task, config.seed)
    ours, _ = run(task, config, 1, DiLoCoSettings(sync_every=4, outer_lr=1.0, outer_momentum=0.0), initial)
    save_file(initial, tmp_path / "initial.safetensors")
    assert max_abs_diff(ours, replay(task, config, str(tmp_path / "initial.safetensors"))) < TOL


class _Constant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))


C = torch.tensor([1.0, -2.0, 0.5])


def _constant_loss(model: nn.Module, batch) -> torch.Tensor:
    x, _ = batch
    return (model.w * C).sum() + 0.0 * x.sum()  # the gradient is C whatever the samples


def test_a_constant_gradient_gives_the_closed_form_of_the_outer_nesterov_update():
    """Inner SGD (η = 0.1, H = 2) on a gradient C: every replica moves by H·η·C, so Δ = HηC
    each outer step (whatever the slices: 3 and 2 of 5). torch's Nesterov SGD then moves θ
    by lr·(g + μ·b_t), b_t = g·(1 − μ^t)/(1 − μ), after t outer steps: 3 of them here. A
    sign error in Δ moves θ the other way."""
    task = Task(model=_Constant, dataset=Regression, loss=_constant_loss,
                optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                defaults=TrainConfig(steps=6, global_batch=5, seed=0))
    lr, mu, H = 0.7, 0.9, 2
    initial = initial_weights(task, 0)
    ours, _ = run(task, task.defaults, 2, DiLoCoSettings(sync_every=H, outer_lr=lr, outer_momentum=mu), initial)
    g = H * 0.1 * C
    moved = sum(lr * (g + mu * g * (1 - mu ** t) / (1 - mu)) for t in (1, 2, 3))
    assert torch.allclose(ours["w"], initial["w"] - moved, atol=1e-6), (ours["w"], initial["w"] - moved)  # 2.4e-7


@pytest.mark.parametrize("world", [2, 3])
def test_the_replicas_follow_the_replay_of_the_contract_and_hold_the_same_theta(world):
    """The tiny GPT, inner AdamW (clipping, warmup), H = 4, outer Nesterov (0.7, 0.9), 12
    inner steps of 13 samples (uneven slices): the one-process replay within 2e-5 (AdamW's
    float32 order noise over 12 steps; one skipped inner step moves it ~1e-2), and every
    rank's θ bit for bit the same after each outer step."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=12, global_batch=13, micro_batch=None)
    assert len({len(s) for s in split(np.arange(13), world)}) == 2
    initial = initial_weights(task, config.seed)
    settings = DiLoCoSettings(sync_every=4)
    ours, thetas = run(task, config, world, settings, initial)
    expected, history = replay_diloco(task, config, initial, world=world, sync_every=4, outer_lr=0.7,
                                      outer_momentum=0.9)
    assert max_abs_diff(ours, initial) > 1e-3
    assert max_abs_diff(ours, expected) < TOL
    assert len(thetas[0]) == len(history) == 3
    for t in range(3):
        assert all(torch.equal(thetas[r][t], thetas[0][t]) for r in range(world)), t
        assert max_abs_diff({"theta": thetas[0][t]}, {"theta": torch.cat([h.reshape(-1) for h in history[t]])}) < TOL


@pytest.mark.parametrize(("settings", "says"), [
    (dict(mode="diloco", zero=1), "--zero is read only with --mode sync, and this run is --mode diloco"),
    (dict(mode="diloco", balance=True), "--balance is read only with --mode sync"),
    (dict(mode="diloco", sync_every=4, eval_every=6), "must be a multiple of"),
    (dict(mode="diloco", outer_momentum=1.0), "outer_momentum must be in [0, 1)"),
    (dict(mode="diloco", sync_every=0), "sync_every must be >= 1"),
    (dict(mode="diloco", prefetch=True), "--prefetch is read only with --mode sync"),
])
def test_settings_diloco_cannot_honour_are_refused_naming_them(settings, says):
    from elastic_dp import ConfigError

    with pytest.raises(ConfigError) as raised:
        TrainConfig(**settings)
    assert says in raised.value.args[0]  # the message as the CLI words it (str() words it for the API)


def test_a_diloco_run_refuses_checkpoints_and_faults_off_its_outer_boundaries():
    from elastic_dp import CheckpointConfig, ClusterConfig, ConfigError, Trainer
    from elastic_dp.faults import parse_faults

    config = dataclasses.replace(TINY_GPT_TASK.defaults, mode="diloco", sync_every=4, steps=12)
    with pytest.raises(ConfigError, match="must be a multiple of"):
        Trainer(TINY_GPT_TASK, train=config, checkpoint=CheckpointConfig(dir="/nonexistent/x", every=6))
    cluster = ClusterConfig(workers=3, min_workers=1)
    with pytest.raises(ConfigError, match="join at a multiple of"):
        parse_faults(["join:step=6"], config, cluster, CheckpointConfig())
    with pytest.raises(ConfigError, match=r"phase=forward\) only"):
        parse_faults(["kill:step=5:rank=1:phase=allreduce"], config, cluster, CheckpointConfig())
    assert len(parse_faults(["join:step=8", "kill:step=5:rank=1"], config, cluster, CheckpointConfig())) == 2


def test_a_bf16_outer_reduction_halves_the_bytes_and_rounds_the_pseudo_gradient_only():
    """``--outer-reduce bf16``: the all-reduce carries half the bytes; after one outer step
    of local SGD (outer lr 1, no momentum) θ differs from the fp32 run's, by at most bf16's
    rounding of Δ (2^-8 of its norm), and every rank holds the same θ."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=4, micro_batch=None)
    initial = initial_weights(task, config.seed)
    figures = {}

    def run_with(reduce):
        sampler = ElasticSampler(len(task.dataset()), global_batch=config.global_batch, seed=config.seed)

        def rank_fn(group):
            replica = Replica(task, config, CPU, group)
            replica.model.load_state_dict(initial)
            replica.broadcast_state(0)
            program = DiLoCoProgram(replica, DiLoCoSettings(sync_every=4, outer_lr=1.0, outer_momentum=0.0,
                                                           outer_reduce=reduce))
            program.start()
            for step in range(4):
                mine = split(sampler.batch(step), 2)[group.rank]
                program.inner_step(step, mine)
            figures[reduce, group.rank] = program.outer_step(len(mine), config.global_batch)
            return torch.cat([t.detach().reshape(-1).clone() for t in program.theta])

        return run_ranks(2, rank_fn)

    fp32, bf16 = run_with("fp32"), run_with("bf16")
    assert torch.equal(bf16[0], bf16[1])
    assert figures["bf16", 0]["bytes"] * 2 == figures["fp32", 0]["bytes"]
    moved = float((fp32[0] - bf16[0]).abs().max())
    assert 0 < moved <= 2 ** -8 * figures["fp32", 0]["pseudo_gradient_norm"]


@pytest.mark.parametrize("reduce", ["int8", "int4"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_quantized_outer_reduction_follows_the_replay_of_its_contract(reduce, world):
    """``--outer-reduce int8|int4``: 12 inner steps of the tiny GPT (H = 4, AdamW, outer
    Nesterov) at 2 and 3 replicas on the replay that simulates each member's blockwise
    quantization and the error it carries to its next outer step (tests.reference
    ``quantized_sum``, written from docs/diloco.md): the same up to float order (measured 0:
    the integers snap it), and off the fp32 run's replay by far more (int8 2.0e-4 to 5.6e-4,
    int4 7.3e-3 to 8.4e-3)."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=12, micro_batch=None)
    initial = initial_weights(task, config.seed)
    settings = DiLoCoSettings(sync_every=4, outer_lr=0.7, outer_momentum=0.9, outer_reduce=reduce)
    ours, thetas = run(task, config, world, settings, initial)
    expected, _ = replay_diloco(task, config, initial, world=world, sync_every=4, outer_lr=0.7, outer_momentum=0.9,
                                outer_reduce=reduce)
    unquantized, _ = replay_diloco(task, config, initial, world=world, sync_every=4, outer_lr=0.7,
                                   outer_momentum=0.9)
    assert max_abs_diff(ours, expected) < TOL
    assert max_abs_diff(ours, unquantized) > 5 * TOL
    assert all(torch.equal(t, thetas[0][-1]) for t in (r[-1] for r in thetas))  # one θ on every member


def test_blockwise_quantization_keeps_each_element_within_half_a_step_and_packs_int4_two_to_a_byte():
    from elastic_dp.comm.quantize import BLOCK, dequantize, quantize, wire_numel

    x = torch.randn(4 * BLOCK, generator=torch.Generator().manual_seed(0))
    x[BLOCK:2 * BLOCK] = 0.0  # a block of zeros is sent as zeros
    for bits, top in ((8, 127), (4, 7)):
        payload, scales = quantize(x, bits)
        assert payload.dtype == torch.uint8 and payload.numel() == x.numel() * bits // 8
        assert wire_numel(x.numel(), bits) == payload.numel() + 4 * scales.numel()
        back = dequantize(payload, scales, bits)
        steps = scales.repeat_interleave(BLOCK)
        assert torch.all((back - x).abs() <= steps / 2 + 1e-7)
        assert torch.equal(back[BLOCK:2 * BLOCK], torch.zeros(BLOCK))
        blocks = x.view(-1, BLOCK).abs().amax(dim=1)
        assert torch.allclose(scales, blocks / top)
        assert torch.allclose(back.view(-1, BLOCK).abs().amax(dim=1), blocks)  # each block's largest is exact


def test_a_quantized_outer_reduction_sends_a_quarter_or_an_eighth_of_the_bytes():
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=4, micro_batch=None)
    initial = initial_weights(task, config.seed)
    sampler = ElasticSampler(len(task.dataset()), global_batch=config.global_batch, seed=config.seed)
    figures = {}

    def rank_fn(group, reduce):
        replica = Replica(task, config, CPU, group)
        replica.model.load_state_dict(initial)
        replica.broadcast_state(0)
        program = DiLoCoProgram(replica, DiLoCoSettings(sync_every=4, outer_reduce=reduce))
        program.start()
        for step in range(4):
            program.inner_step(step, split(sampler.batch(step), 2)[group.rank])
        figures[reduce] = program.outer_step(6, config.global_batch)["bytes"]

    for reduce in ("fp32", "int8", "int4"):
        run_ranks(2, lambda group, reduce=reduce: rank_fn(group, reduce))
    params = sum(p.numel() for p in task.model().parameters())
    assert figures["fp32"] == 4 * params
    assert 0.25 < figures["int8"] / figures["fp32"] < 0.27 and 0.125 < figures["int4"] / figures["fp32"] < 0.145
