"""ZeRO stage 3 on gloo ranks run as threads (no Ray): the parameters of stage 0 and of a
plain PyTorch replay at 1, 2 and 3 ranks (uneven slices), with and without
``--no-reshard-after-forward``, the default units and a task's own; between steps no
rank holds more of a parameter than its chunk; checkpoints at other world sizes and stages."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from elastic_dp import ConfigError, ElasticSampler, Task, TrainConfig
from elastic_dp.data import split
from elastic_dp.durable.checkpoint import Checkpoint, CheckpointStore, manifest_of, write_part
from elastic_dp.durable.weights import save_tensor_parts
from elastic_dp.errors import API_NAMES, CollectiveError
from elastic_dp.modes.sync.program import SyncProgram
from elastic_dp.observe.capacity import MemoryPlan
from elastic_dp.state.units import default_units
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.reference import max_abs_diff, replay
from tests.tasks import CNN_TASK, MLP_TASK, TINY_GPT_TASK, Regression, mlp
from tests.test_eval import REL, plain_eval
from tests.zero_runs import CPU, initial_weights, train

TOL = 2e-5  # float32 reduction order; worst measured 3.4e-06 (23 tests here, 3 suite runs on 2026-12-04,
# python -m tests.noise; thread ranks: the same figure in each run): 6x margin

MLP_UNITS = dataclasses.replace(MLP_TASK, shard_units=lambda model: [model[0], model[2]])
"""The MLP has no ModuleList: two of its Linear layers are units, the last one the root."""


@pytest.mark.parametrize("task", [MLP_UNITS, TINY_GPT_TASK], ids=["sgd-two-groups", "adamw-gpt"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("reshard", "micro"), [(True, None), (False, None), (True, 2)],
                         ids=["reshard", "keep", "micro-batches"])
def test_stage_3_reaches_the_parameters_of_stage_0_and_of_the_replay(task, world, reshard, micro, tmp_path):
    """6 steps (global batch 14 over 3 ranks: slices of 5, 5 and 4; with micro-batches of
    2 the last rank has 2 where the others have 3, and runs a pass that adds nothing);
    stage 0's bound (test_zero.py: 2e-5, float32 order noise of AdamW over 6 steps, ~2e-6
    measured)."""
    config = dataclasses.replace(task.defaults, steps=6, global_batch=14, micro_batch=micro)
    initial = initial_weights(task, config.seed)
    reference, _, _ = train(task, config, world, range(6), initial)
    sharded, _, replicas = train(task, dataclasses.replace(config, zero=3, reshard_after_forward=reshard), world,
                                 range(6), initial)
    assert max_abs_diff(sharded, reference) < TOL
    save_file(initial, tmp_path / "initial.safetensors")
    expected = replay(task, config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(sharded, expected) < TOL
    strategy = replicas[0].strategy
    assert len(strategy.units) == (2 if task is TINY_GPT_TASK else 2)
    held = sum(s.numel() for s in strategy.param_chunks)
    total = sum(p.numel() for p in replicas[0].model.parameters())
    assert held == sum(strategy.chunks) and held * world >= total and held <= -(-total // world) + len(strategy.chunks)
    assert all(b.untyped_storage().size() == 0 for b in strategy.param_buffers), "a gathered unit was left"


@pytest.mark.parametrize("sizes", [(6, 4), (2, 4, 6)])
def test_batch_norm_under_stage_3_with_micro_batches_equals_stage_0(sizes):
    """The CNN with BatchNorm (its parameters all in the root unit), micro-batches of 2 of
    a global batch of 12 in slices of the given sizes (as ``--balance`` makes them): the
    ranks with fewer micro-batches run padding passes, which must leave the running
    statistics as they were (one that moved them left them 0.58 off); the parameters and
    statistics of stage 0 within 2e-4 of the values' scale: stage 3 sums each micro-batch's
    reduced chunks where stage 0 sums the full gradients first (and the all-to-all sums in
    the order the pieces arrive), and BatchNorm over 2 samples amplifies that order
    (measured 1.1e-5 and 1.7e-5 apart alone, more under the parallel suite's load; stage 2,
    whose order is stage 0's, 0 and 1.2e-7)."""
    config = dataclasses.replace(CNN_TASK.defaults, steps=4, global_batch=sum(sizes), micro_batch=2)
    initial = initial_weights(CNN_TASK, config.seed)
    reference, _, _ = train(CNN_TASK, config, len(sizes), range(4), initial, sizes=sizes)
    sharded, _, _ = train(CNN_TASK, dataclasses.replace(config, zero=3), len(sizes), range(4), initial, sizes=sizes)
    for key, value in reference.items():
        assert float((sharded[key].float() - value.float()).abs().max()) <= 2e-4 * max(1.0, float(value.abs().max()))
    assert int(sharded["1.num_batches_tracked"]) == int(reference["1.num_batches_tracked"])


def test_default_units_are_the_children_of_the_outermost_module_lists():
    model = TINY_GPT_TASK.model()
    assert default_units(model) == list(model.blocks)


def _saved_at_stage_3(task, config, world: int, steps: range, initial, tmp_path) -> Checkpoint:
    """Train ``steps`` at ``config``'s stage on ``world`` ranks and save a checkpoint as the
    ranks do: each writes its ``checkpoint_part``; the manifest joins them."""
    parts = {}

    def save(replica) -> None:
        parts[replica.group.rank] = replica.checkpoint_part(steps.stop, {"seed": config.seed})

    train(task, config, world, steps, initial, before_exit=save)
    store = CheckpointStore(str(tmp_path / f"ckpt-{config.stage.number}-{world}"))
    directory = store.begin(steps.stop)
    reports = [write_part(store.storage, directory, parts[r]) for r in range(world)]
    return store.commit(directory, manifest_of(reports, step=steps.stop, sampler={"seed": config.seed},
                                               world_size=world))


def test_a_stage_3_checkpoint_resumes_at_stage_0_and_2_at_other_world_sizes_and_back(tmp_path):
    """Saved at stage 3 by 3 ranks after 3 steps, each holding only its chunks: every
    parameter is whole in the checkpoint, and every rank wrote about a third of each;
    resumed at stage 0 on 2 ranks and at stage 2 on 4, and the stage-0 state saved then
    resumed at stage 3 on 3: each ends where 6 uninterrupted steps end (stage 0's bound)."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=6, micro_batch=None, zero=3)
    initial = initial_weights(task, config.seed)
    uninterrupted, _, _ = train(task, dataclasses.replace(config, zero=0), 1, range(6), initial)
    at3, _, _ = train(task, config, 3, range(3), initial)
    checkpoint = _saved_at_stage_3(task, config, 3, range(3), initial, tmp_path)
    saved = checkpoint.read()
    assert saved.step == 3 and max_abs_diff(saved.model, at3) == 0.0, "the parts are the chunks, bit for bit"
    shares: dict[str, int] = {}  # elements of the model's parameters each rank's file holds
    params = [name for name, _ in task.model().named_parameters()]  # a tied one once
    for key in params:
        for file, _, n in checkpoint.manifest["tensors"][f"model/{key}"]["pieces"]:
            shares[file] = shares.get(file, 0) + n
    total, pieces = sum(saved.model[k].numel() for k in params), 2 * 2 + 2  # units' and root's pieces, ≤ 2 kinds
    assert len(shares) == 3 and all(abs(n - total / 3) <= 2 * pieces for n in shares.values()), shares
    for zero, world in ((0, 2), (2, 4)):
        resumed, _, _ = train(task, dataclasses.replace(config, zero=zero), world, range(3, 6), None, start=saved)
        assert max_abs_diff(resumed, uninterrupted) < TOL, (zero, world)
    _, states, _ = train(task, dataclasses.replace(config, zero=0), 2, range(3), initial)
    back, _, replicas = train(task, config, 3, range(3, 6), None, start=states[0])
    assert max_abs_diff(back, uninterrupted) < TOL


def test_a_checkpoint_loads_at_stage_3_reading_only_the_rank_s_chunks(tmp_path, monkeypatch):
    """Checkpoints saved at stage 3 by 3 ranks and at stage 0 by 2 (after 3 steps of the
    tiny GPT) load at stage 3 on 2 and on 4 ranks from the checkpoint itself: each rank
    reads its chunk and its left neighbour's of the parameters and their optimizer state,
    and the buffers (the element ranges it asks for, and every tensor it is given whole:
    2/4 of the parameters and of each optimizer-state tensor at 4 ranks); at the resume the parameters are the
    saved ones bit for bit, and each run ends where 6 uninterrupted steps end (stage 0's
    bound)."""
    from elastic_dp.durable import checkpoint as checkpoint_module

    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=6, micro_batch=None, zero=3)
    initial = initial_weights(task, config.seed)
    uninterrupted, _, _ = train(task, dataclasses.replace(config, zero=0), 1, range(6), initial)
    read: list[int] = []
    real = checkpoint_module.read_ranges

    def counted(storage, directory, manifest, ranges, whole):
        got, state = real(storage, directory, manifest, ranges, whole)
        read.append(sum(t.numel() for t in got.values()) + sum(t.numel() for t in state.model.values()))
        return got, state

    monkeypatch.setattr(checkpoint_module, "read_ranges", counted)
    params = sum(p.numel() for p in task.model().parameters())
    for saved_zero, saved_world in ((3, 3), (0, 2)):
        saved = _saved_at_stage_3(task, dataclasses.replace(config, zero=saved_zero), saved_world, range(3),
                                  initial, tmp_path)
        whole = saved.read()
        for world in (2, 4):
            read.clear()
            at_resume, _, _ = train(task, config, world, range(3, 3), None, start=saved)
            assert max_abs_diff(at_resume, {k: whole.model[k] for k in at_resume}) == 0.0
            assert len(read) == world
            if world == 4:  # own + left: 2/N of the parameters and of each optimizer-state tensor
                kinds = 1 + len({k.rpartition("/")[2] for k in saved.manifest["tensors"] if k.startswith("optim/")})
                assert max(read) <= kinds * params * 2 / world + 64, (read, kinds, params)
            resumed, _, _ = train(task, config, world, range(3, 6), None, start=saved)
            assert max_abs_diff(resumed, uninterrupted) < TOL, (saved_zero, saved_world, world)


def test_the_units_are_freed_after_their_forward_unless_kept():
    """Which units are gathered when each unit's forward starts: the one before it is gone
    already (its backward gathers it again), except with ``reshard_after_forward=False``."""
    seen = {}
    for reshard in (True, False):
        config = dataclasses.replace(TINY_GPT_TASK.defaults, steps=1, micro_batch=None, zero=3,
                                     reshard_after_forward=reshard)

        def probe(replica, reshard=reshard):
            strategy = replica.strategy
            record = seen.setdefault((reshard, replica.group.rank), [])  # the ranks are threads
            for u, unit in enumerate(strategy.units):
                unit.register_forward_pre_hook(lambda _m, _a, u=u: record.append((u, sorted(strategy._gathered))))
        train(TINY_GPT_TASK, config, 2, range(1), initial_weights(TINY_GPT_TASK, config.seed), after_build=probe)
    root = 2
    for rank in (0, 1):
        assert seen[True, rank] == [(0, [0, 1, root]), (1, [1, root])]
        assert seen[False, rank] == [(0, [0, 1, root]), (1, [0, 1, root])]


def _failing_loss(rank: int):
    """The task's loss, except that rank 1's second call raises."""
    calls = []

    def loss(model, batch):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise ValueError("the task's loss failed")
        return TINY_GPT_TASK.loss(model, batch)
    return loss


def test_a_rank_whose_forward_raises_aborts_the_group_and_its_error_is_the_step_s():
    """The failing rank cannot issue its peers' gathers in their order: it aborts the
    group, its peer's gather fails at once (no hang), and the step commits nowhere."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, micro_batch=None, zero=3, init="whole")
    sampler = ElasticSampler(len(task.dataset()), global_batch=config.global_batch, seed=config.seed)
    initial = initial_weights(task, config.seed)

    def rank_fn(group):
        replica = Replica(dataclasses.replace(task, loss=_failing_loss(group.rank)), config, CPU, group)
        replica.model.load_state_dict(initial)
        replica.broadcast_state(0)
        program = SyncProgram(replica)
        return [program.step(s, split(sampler.batch(s), 2)[group.rank]) for s in range(2)]

    started = time.monotonic()
    results = run_ranks(2, rank_fn)
    assert time.monotonic() - started < 20
    assert [r.committed for r in results[0]] == [True, False] and [r.committed for r in results[1]] == [True, False]
    assert "the task's loss failed" in str(results[1][1].error)
    assert isinstance(results[0][1].error, CollectiveError)


@pytest.mark.parametrize(("settings", "flag"), [
    (dict(zero=2, reshard_after_forward=False), "--no-reshard-after-forward"),
])
def test_a_stage_3_setting_without_stage_3_is_refused_naming_it(settings, flag):
    with pytest.raises(ConfigError) as raised:
        TrainConfig(**settings)
    assert API_NAMES[flag].split("(")[0] in str(raised.value)  # the API's name of it (the CLI shows the flag)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_what_each_rank_holds_at_stage_3_is_the_plan_s_share(world):
    """``state_bytes`` (the ``state_memory`` event's figures) after a step, against
    ``elastic-dp plan --zero 3`` for fp32 AdamW (4 + 4 + 8 bytes a parameter, over N):
    within 5%, plus the pieces' padding (under N elements each) and AdamW's step counts."""
    config = dataclasses.replace(TINY_GPT_TASK.defaults, steps=1, micro_batch=None, zero=3)
    _, _, replicas = train(TINY_GPT_TASK, config, world, range(1), initial_weights(TINY_GPT_TASK, config.seed))
    psi = sum(p.numel() for p in replicas[0].model.parameters())
    plan = MemoryPlan(psi, world, 3, precision="fp32", optimizer="adamw").per_worker_bytes()
    for replica in replicas:
        held = replica.strategy.state_bytes()
        pieces = len(replica.strategy.buckets)
        slack = 4 * pieces * world + 8 * pieces  # padding of each piece's chunks, one step count a piece
        for key in ("parameters", "gradients", "optimizer_state"):
            assert abs(held[key] - plan[key]) <= 0.05 * plan[key] + 2 * slack, (key, held[key], plan[key])
        assert held["snapshots"] > 0


@pytest.mark.parametrize("world", [2, 3])
def test_an_evaluation_at_stage_3_is_the_plain_mean_and_frees_every_unit(world):
    """The tiny GPT's 249 held-out windows in micro-batches of 4 (2 ranks: 32 and 31 of
    them; the second runs a forward that counts nothing), gathered unit by unit: the plain
    one-process mean (test_eval.py's bound), and nothing left gathered."""
    config = dataclasses.replace(TINY_GPT_TASK.defaults, eval_every=1, zero=3, init="whole")
    initial = initial_weights(TINY_GPT_TASK, config.seed)
    n = len(TINY_GPT_TASK.eval_dataset())
    micro = config.micro_batch
    shares = split(np.arange(n), world)
    passes = max(-(-len(s) // micro) for s in shares)

    def rank_fn(group):
        replica = Replica(TINY_GPT_TASK, config, CPU, group)
        replica.model.load_state_dict(initial)
        replica.broadcast_state(0)
        share = shares[group.rank]
        result = replica.evaluate(int(share[0]), int(share[-1]) + 1, passes)
        return result, [b.untyped_storage().size() for b in replica.strategy.param_buffers]

    results = run_ranks(world, rank_fn)
    assert sum(samples for (_, samples), _ in results) == n
    assert sum(loss for (loss, _), _ in results) / n == pytest.approx(plain_eval(TINY_GPT_TASK, initial), rel=REL)
    assert all(size == 0 for _, sizes in results for size in sizes)


def test_the_weights_file_at_stage_3_is_written_a_unit_at_a_time_and_is_the_model_s(tmp_path):
    """The deep MLP on 3 ranks: rank 0 writes final weights from one gathered unit at a
    time (the largest part under a tenth of the model), and safetensors reads back the
    model's state dict exactly; the ranks' parameter buffers are all freed after it."""
    from safetensors.torch import load_file

    from elastic_dp.durable.storage import Storage
    from tests.tasks import DEEP_TASK
    from tests.test_zero3_init import _held

    config = dataclasses.replace(DEEP_TASK.defaults, steps=2, zero=3)
    largest: dict[int, int] = {}

    def write(replica):
        strategy = replica.strategy
        before = _held(replica)
        part = strategy.weight_part

        def measured(i):
            result = part(i)
            largest[replica.group.rank] = max(largest.get(replica.group.rank, 0),
                                              sum(t.numel() * t.element_size() for t in result.values()))
            return result

        strategy.weight_part = measured
        specs = strategy.weight_parts()
        parts = (strategy.weight_part(i) for i in range(len(specs)))
        if replica.group.rank == 0:
            save_tensor_parts(Storage(tmp_path), "final.safetensors", [t for part in specs for t in part], parts)
        for _ in parts:
            pass
        assert _held(replica) == before

    final, _, _ = train(DEEP_TASK, config, 3, range(2), None, before_exit=write)
    written = load_file(tmp_path / "final.safetensors")
    assert written.keys() == final.keys() and all(torch.equal(written[k], final[k]) for k in final)
    model_bytes = sum(v.numel() * 4 for v in final.values())
    assert 0 < max(largest.values()) < model_bytes / 10


def _bf16_loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)


BF16_TASK = Task(model=lambda: mlp().to(torch.bfloat16), dataset=Regression, loss=_bf16_loss,
                 optimizer=lambda model: torch.optim.Adam(model.parameters(), lr=1e-3),
                 shard_units=lambda model: [model[0], model[2]], defaults=TrainConfig(global_batch=8, seed=1))
"""test_zero.py's bf16 MLP, two of its layers units."""


def test_bf16_parameters_are_gathered_from_fp32_master_chunks_as_stage_1_keeps_them():
    """bf16 parameters (an Adam step of 1e-3 is below their resolution: only fp32 masters
    accumulate it): stage 3's masters are fp32 chunks, its bf16 parameters their rounding,
    and both equal stage 1's (the same fp32 reduction and update: within 1e-6 for the
    masters, exactly for the bf16 parameters they round to, but for a rare tie)."""
    from elastic_dp.durable.checkpoint import merge_parts

    task = BF16_TASK
    config = dataclasses.replace(task.defaults, zero=1)
    initial = initial_weights(task, config.seed)
    stage1, parts1, _ = train(task, config, 2, range(5), initial)
    stage3, parts3, replicas = train(task, dataclasses.replace(config, zero=3), 2, range(5), initial)
    assert all(m.dtype == torch.float32 for m in replicas[0].strategy.masters)
    assert all(s.dtype == torch.bfloat16 for s in replicas[0].strategy.param_chunks)
    m1, m3 = merge_parts(parts1).optimizer_tensors, merge_parts(parts3).optimizer_tensors
    assert max_abs_diff({"master": m3["0.weight/master"]}, {"master": m1["0.weight/master"]}) < 1e-6  # measured 0
    assert float((m3["0.weight/master"] - stage3["0.weight"].float()).abs().max()) > 0  # the masters moved further
    torch.testing.assert_close(m3["0.weight/master"].to(torch.bfloat16), stage3["0.weight"])
    assert max_abs_diff(stage3, stage1) <= 2 ** -8 * max(float(v.float().abs().max()) for v in stage1.values())


def test_balanced_slices_under_stage_3_reach_stage_0():
    """--balance's uneven slices (3 and 11 of 14): the same parameters as stage 0 with the
    same slices (stage 0's bound, 2e-5)."""
    config = dataclasses.replace(TINY_GPT_TASK.defaults, steps=6, global_batch=14, micro_batch=4)
    initial = initial_weights(TINY_GPT_TASK, config.seed)
    reference, _, _ = train(TINY_GPT_TASK, config, 2, range(6), initial, sizes=(3, 11))
    sharded, _, _ = train(TINY_GPT_TASK, dataclasses.replace(config, zero=3), 2, range(6), initial, sizes=(3, 11))
    assert max_abs_diff(sharded, reference) < TOL


def test_a_non_finite_step_under_stage_3_is_skipped_on_every_rank():
    """Step 3's first sample is NaN (rank 0's): no rank updates its chunks, and the run ends
    on stage 0's parameters, which skipped it too."""
    from tests.tasks import PoisonedRegression

    task = dataclasses.replace(MLP_UNITS, dataset=PoisonedRegression)
    config = dataclasses.replace(task.defaults, steps=6)
    initial = initial_weights(task, config.seed)
    reference, _, _ = train(task, config, 2, range(6), initial)
    sharded, _, replicas = train(task, dataclasses.replace(config, zero=3), 2, range(6), initial)
    assert max_abs_diff(sharded, reference) < TOL
    assert all(torch.isfinite(v).all() for v in sharded.values())


# -- --param-dtype bf16 (fp32 masters, bf16 gathers; FSDP2's comparison: test_fsdp2_reference) -----
def test_bf16_gathers_hold_half_the_parameter_bytes_and_the_kept_modules_whole_fp32():
    """The chunks a rank holds between steps, which the all-gathers send: bf16 (2 bytes a
    parameter) except the kept modules' (fp32); the masters and the optimizer state fp32."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=1, micro_batch=None, zero=3)
    initial = initial_weights(task, config.seed)
    fp32 = train(task, config, 2, range(1), initial)[2][0].strategy
    bf16 = train(task, dataclasses.replace(config, param_dtype="bf16"), 2, range(1), initial)[2][0].strategy
    kept = train(task, dataclasses.replace(config, param_dtype="bf16", keep_fp32="*ln*"), 2, range(1),
                 initial)[2][0].strategy
    assert bf16.state_bytes()["parameters"] * 2 == fp32.state_bytes()["parameters"]
    ln = sum(p.numel() for n, p in task.model().named_parameters() if "ln" in n)
    assert abs(kept.state_bytes()["parameters"] - (bf16.state_bytes()["parameters"] + 2 * ln / 2)) <= 4 * 8
    assert {c.dtype for c in bf16.param_chunks} == {torch.bfloat16} and {m.dtype for m in bf16.masters} == {
        torch.float32}
    assert {c.dtype for c in kept.param_chunks} == {torch.bfloat16, torch.float32}


def test_a_bf16_checkpoint_keeps_the_fp32_masters_and_resumes_at_another_dtype_policy(tmp_path):
    """Saved by 2 ranks at --param-dtype bf16 after 3 steps: the checkpoint's model tensors
    are the fp32 masters (the dtype the model holds them in), bit for bit the run's final
    weights; loaded at stage 3 in fp32 on 3 ranks and at stage 0, the parameters are those
    masters exactly; and an fp32 checkpoint loaded under bf16 gathers keeps its values as masters."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=3, micro_batch=None, zero=3, param_dtype="bf16")
    initial = initial_weights(task, config.seed)
    final, _, _ = train(task, config, 2, range(3), initial)
    checkpoint = _saved_at_stage_3(task, config, 2, range(3), initial, tmp_path)
    saved = checkpoint.read()
    assert all(v.dtype == torch.float32 for v in saved.model.values())
    assert max_abs_diff(saved.model, final) == 0.0
    for other, world in ((dataclasses.replace(config, param_dtype="fp32"), 3), (dataclasses.replace(config, zero=0),
                                                                                 2)):
        loaded, _, _ = train(task, other, world, range(3, 3), None, start=checkpoint)
        assert max_abs_diff(loaded, final) == 0.0, (other.stage.number, world)
    fp32_checkpoint = _saved_at_stage_3(task, dataclasses.replace(config, param_dtype="fp32"), 2, range(3), initial,
                                        tmp_path / "fp32")
    loaded, _, replicas = train(task, config, 2, range(3, 3), None, start=fp32_checkpoint)
    assert max_abs_diff(loaded, fp32_checkpoint.read().model) == 0.0
    assert {m.dtype for m in replicas[0].strategy.masters} == {torch.float32}


def test_param_dtype_and_keep_fp32_are_stage_3_settings_refused_elsewhere_naming_them():
    with pytest.raises(ConfigError, match=r"TrainConfig\.keep_fp32 \*ln\* keeps modules in fp32"):
        TrainConfig(zero=3, keep_fp32="*ln*")
    for settings in ({"zero": 2, "param_dtype": "bf16"}, {"param_dtype": "bf16"}):
        with pytest.raises(ConfigError, match=r"TrainConfig\.param_dtype"):
            TrainConfig(**settings)


def test_a_step_gathers_what_the_plan_counts_the_root_and_the_last_unit_once(monkeypatch):
    """The elements a stage-3 step puts through its all-gathers and reduce-scatters, counted at
    the collective group's calls (one step: a run of 2 steps less a run of 1, which cancels the
    build's and the final weights' gathers), less the pieces' padding to a multiple of the world
    size: exactly ``elastic-dp plan``'s count, every parameter gathered twice but the root
    unit's and the last unit's (``units.gathered_once``), every gradient reduce-scattered once,
    and the commit vote beside them (a few elements a parameter tensor, which the plan leaves
    out)."""
    from elastic_dp.comm.group import CollectiveGroup
    from elastic_dp.comm.vote import Ballot
    from elastic_dp.state.units import gathered_once, model_units

    world, counted, strategies = 2, {}, []
    gather, scatter = CollectiveGroup.all_gather_async, CollectiveGroup.reduce_scatter_async

    def count(kind, tensor):
        counted[kind] = counted.get(kind, 0) + tensor.numel()

    monkeypatch.setattr(CollectiveGroup, "all_gather_async",
                        lambda self, out, inp: (count("gathered", out), gather(self, out, inp))[1])
    monkeypatch.setattr(CollectiveGroup, "reduce_scatter_async",
                        lambda self, out, inp: (count("scattered", inp), scatter(self, out, inp))[1])
    config = dataclasses.replace(TINY_GPT_TASK.defaults, micro_batch=None, zero=3)
    per_run = []
    for steps in (1, 2):
        counted.clear()
        train(TINY_GPT_TASK, dataclasses.replace(config, steps=steps), world, range(steps),
              initial_weights(TINY_GPT_TASK, config.seed), after_build=strategies.append)
        per_run.append(dict(counted))
    step = {k: (per_run[1][k] - per_run[0][k]) / world for k in per_run[1]}  # elements a rank
    strategy = strategies[0].strategy
    once_units = {strategy.root, strategy.root - 1}
    padding = {u: sum(strategy.buckets[b].padded - strategy.buckets[b].numel for b in bs)
               for u, bs in strategy.unit_buckets.items()}
    gather_padding = sum(p * (1 if u in once_units else 2) for u, p in padding.items())
    model = TINY_GPT_TASK.model()
    params = sum(p.numel() for p in model.parameters())
    once = gathered_once(model, model_units(model, TINY_GPT_TASK.shard_units))
    assert 0 < once < params
    # the vote rides the last piece, whole in every rank's chunk: counts, a use flag a parameter
    vote = world * (Ballot.COUNTS + len(list(model.parameters())))
    assert (step["gathered"] - gather_padding, step["scattered"] - sum(padding.values()) - vote) == \
        (2 * params - once, params), (step, padding, params, once)
    plan = MemoryPlan(params, world, 3, precision="fp32", gathered_once=once).comm_bytes_per_step()
    assert plan == pytest.approx((world - 1) / world * 4 * (2 * params - once + params), rel=1e-12)
