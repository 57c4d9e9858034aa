"""Parameters without a gradient (issue 43): a parameter that no sample of a step used, on
any worker, is left as plain PyTorch leaves a ``None`` gradient (no update, no moment or
weight decay, its own step count not advanced), at ZeRO stages 0, 2 and 3, through a kill,
a join and a resume at another stage and world size; one that some workers used gets the
sum of their gradients. The model is a hand-written Mixture-of-Experts (one module per
expert in a ``ModuleList``, top-1 of 16, AdamW with weight decay, slices of 2-4 samples):
each step leaves about half of its experts unused, a different half on each worker. At
ZeRO-3 each expert is a unit of its own, which the ranks' samples skip differently: the
units still take their turns in the same order on every rank (docs/zero.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elastic_dp import CheckpointConfig
from tests.reference import max_abs_diff, replay
from tests.runs import fit
from tests.tasks import MOE_BLOCK_TASK, MOE_TASK, Regression, mse

TOL = 2e-5
# N=1 and N=2 against the plain loop: 0 and 1.2e-7 at 12 steps (2026-12-04); a zero-filled
# gradient instead of None (what elastic_dp did before) moves the run by 1.9e-1: the bound
# is far from both


def _zero_filled(model, batch):
    """The MoE's loss with every parameter in the graph: a zero gradient where it had none."""
    return mse(model, batch) + 0.0 * sum(p.sum() for p in model.parameters())


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_an_expert_no_worker_chose_is_left_alone_through_a_kill_and_a_join(ray_cluster, tmp_path, zero):
    run = fit(MOE_TASK, tmp_path, workers=3, min_workers=1, inject=["join:step=3", "kill:step=7:rank=1"],
              steps=12, zero=zero, bucket_mb=0.0005)
    initial = str(tmp_path / "initial.safetensors")
    expected = replay(MOE_TASK, run.config, initial)
    assert max_abs_diff(run.weights(), expected) < TOL
    # the semantics matter here: zero gradients for the unused experts end far away
    zero_filled = replay(dataclasses.replace(MOE_TASK, loss=_zero_filled), run.config, initial)
    assert max_abs_diff(run.weights(), zero_filled) > 1e-2
    changes = run.changes()
    assert [c["lost_ranks"] for c in changes if c["lost"]] == [[1]]
    assert any(c["joined"] >= 1 and not c["lost"] for c in changes)  # the join at step 3
    assert [m["step"] for m in run.lines("metrics")] == list(range(12))


def test_a_resume_at_another_stage_keeps_each_parameters_own_step_count(ray_cluster, tmp_path):
    # saved at ZeRO-2 over 2 workers after 6 steps: the experts' step counts differ (the
    # checkpoint keeps each parameter's own, and none for an expert never chosen); resumed
    # at ZeRO-3 over 3, then at stage 0 over 1, and trained to 12: on the plain loop
    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=3)
    first = fit(MOE_TASK, tmp_path / "first", workers=2, steps=6, zero=2, checkpoint=ckpt, bucket_mb=0.0005)
    resume = dataclasses.replace(ckpt, resume="latest")
    fit(MOE_TASK, tmp_path / "second", workers=3, steps=9, zero=3, checkpoint=resume)
    third = fit(MOE_TASK, tmp_path / "third", workers=1, steps=12, zero=0, checkpoint=resume)
    expected = replay(MOE_TASK, third.config, str(tmp_path / "first" / "initial.safetensors"))
    assert max_abs_diff(third.weights(), expected) < TOL
    assert first.config.steps == 6


OPTIMIZERS = {  # each element-wise optimizer ZeRO takes, with the settings whose first step or 0-dim state differ
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.02, weight_decay=0.01),  # step and mu_product
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),  # step sizes start at lr, not 0
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.02, amsgrad=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.02),
}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_skips_a_parameter_without_a_gradient_as_torch_does(tmp_path, name, zero):
    # thread ranks (no Ray), 2 of them, small buckets so that experts share chunks and
    # straddle them: every optimizer on the plain loop that leaves None gradients alone
    from safetensors.torch import save_file

    from tests.zero_runs import initial_weights, train

    task = dataclasses.replace(MOE_TASK, optimizer=lambda m: OPTIMIZERS[name](m.parameters()))
    config = dataclasses.replace(task.defaults, steps=8, zero=zero, bucket_mb=0.0002)
    initial = initial_weights(task, config.seed)
    save_file(initial, tmp_path / "initial.safetensors")
    trained, _, _ = train(task, config, 2, range(8), initial)
    assert max_abs_diff(trained, replay(task, config, str(tmp_path / "initial.safetensors"))) < TOL


@pytest.mark.parametrize("task", [MOE_TASK, MOE_BLOCK_TASK], ids=["experts-as-units", "in-a-block"])
@pytest.mark.parametrize("world, settings", [(2, {}), (3, {}), (2, {"reshard_after_forward": False}),
                                             (3, {"micro_batch": 2})], ids=["2", "3", "2-keep", "3-micro"])
def test_zero_3_takes_the_units_every_rank_s_samples_skipped_in_the_same_order(tmp_path, task, world, settings):
    # each expert a unit (16 units and the root), or the layer one unit: the gathers and
    # reduce-scatters of every rank match, and training and a held-out pass over each
    # rank's own samples (choosing other experts) equal the plain loop's
    from safetensors.torch import save_file

    from tests.zero_runs import initial_weights, train

    config = dataclasses.replace(task.defaults, steps=6, zero=3, eval_every=100, **settings)  # the held-out set built
    initial = initial_weights(task, config.seed)
    save_file(initial, tmp_path / "initial.safetensors")
    held_out = {}

    def evaluate(replica):
        rank, ranks = replica.group.rank, replica.group.world_size
        held_out[rank] = replica.evaluate(rank * 96 // ranks, (rank + 1) * 96 // ranks)

    trained, _, replicas = train(task, config, world, range(6), initial, before_exit=evaluate)
    assert replicas[0].strategy.root == (16 if task is MOE_TASK else 1)
    assert max_abs_diff(trained, replay(task, config, str(tmp_path / "initial.safetensors"))) < TOL
    model = task.model()
    model.load_state_dict(trained)
    data = Regression()
    with torch.no_grad():
        expected = float(mse(model, (data.x, data.y))) * len(data)
    assert sum(n for _, n in held_out.values()) == len(data)
    assert abs(sum(total for total, _ in held_out.values()) - expected) < 1e-5 * expected
