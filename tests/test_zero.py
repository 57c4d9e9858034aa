"""ZeRO stages 1 and 2 on gloo ranks run as threads (no Ray): the same parameters as stage 0
and as a plain PyTorch replay, checkpoints at other world sizes, the parameter all-gather
left to the next forward, and the optimizers it refuses. Resharding and peer snapshots:
tests/test_zero_snapshots.py."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn

from elastic_dp import ConfigError, ElasticSampler, Task, TrainConfig
from elastic_dp.data import split
from elastic_dp.durable.checkpoint import merge_parts
from elastic_dp.errors import CollectiveError
from elastic_dp.modes.sync.program import SyncProgram
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.reference import max_abs_diff
from tests.tasks import MLP_TASK, TINY_GPT_TASK, Regression, mlp
from tests.zero_runs import CPU, initial_weights, train

TOL = 2e-5  # float32 reduction order; worst measured 2.4e-06 (17 tests here, 3 suite runs on 2026-12-04,
# python -m tests.noise; thread ranks: the same figure in each run): 8x margin


@pytest.mark.parametrize("task", [MLP_TASK, TINY_GPT_TASK], ids=["sgd-two-groups", "adamw-gpt"])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_stages_reach_the_parameters_of_stage_0(task, zero, world):
    config = dataclasses.replace(task.defaults, steps=6, bucket_mb=0.0001)  # several buckets
    initial = initial_weights(task, config.seed)
    reference, _, _ = train(task, config, world, range(6), initial)
    sharded, _, replicas = train(task, dataclasses.replace(config, zero=zero), world, range(6), initial)
    assert len(replicas[0].strategy.buckets) > 2
    assert all(r.strategy.defer_gather for r in replicas)  # each gather waited for in the next forward
    assert max_abs_diff(sharded, reference) < TOL


class _HeadOutsideForward(nn.Module):
    """The loss reads ``head``'s parameters without calling ``head``: no forward pre-hook
    of theirs runs, so their bucket must arrive before the step ends."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = mlp(), nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _head_outside_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(nn.functional.linear(model(x), model.head.weight, model.head.bias), y)


@pytest.mark.parametrize("zero", [1, 2])
def test_parameters_read_outside_their_modules_forward_are_gathered_at_the_end_of_the_step(zero):
    task = dataclasses.replace(MLP_TASK, model=_HeadOutsideForward, loss=_head_outside_loss,
                               optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    config = dataclasses.replace(task.defaults, steps=5, bucket_mb=0.0001)
    initial = initial_weights(task, config.seed)
    reference, _, _ = train(task, config, 2, range(5), initial)
    sharded, _, replicas = train(task, dataclasses.replace(config, zero=zero), 2, range(5), initial)
    assert [r.strategy.defer_gather for r in replicas] == [False, False]
    assert max_abs_diff(sharded, reference) < TOL


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_autocast_under_zero_tracks_stage_0(zero):
    """--precision bf16 (autocast, fp32 parameters). bf16 matmuls on differently laid-out
    memory round differently, and AdamW turns that into full-size update differences, so,
    as test_sync_equivalence does for bf16, compare whole updates: within 5% (L2) of stage
    0's update (measured 0.3%; a mis-scaled or stale shard is off by 50% or more)."""
    config = dataclasses.replace(TINY_GPT_TASK.defaults, steps=4, precision="bf16")
    initial = initial_weights(TINY_GPT_TASK, config.seed)
    reference, _, _ = train(TINY_GPT_TASK, config, 2, range(4), initial)
    sharded, _, _ = train(TINY_GPT_TASK, dataclasses.replace(config, zero=zero), 2, range(4), initial)

    def flat(state):
        return torch.cat([state[k].float().flatten() for k in sorted(state)])

    update = flat(reference) - flat(initial)
    assert float((flat(sharded) - flat(reference)).norm() / update.norm()) < 0.05


def test_stage_2_keeps_only_gradient_chunks_and_stage_1_keeps_full_gradients():
    config = dataclasses.replace(TINY_GPT_TASK.defaults, steps=1)
    initial = initial_weights(TINY_GPT_TASK, config.seed)
    for zero, world in ((1, 3), (2, 3)):
        _, _, replicas = train(TINY_GPT_TASK, dataclasses.replace(config, zero=zero), world, range(1), initial)
        for replica in replicas:
            numel = sum(p.numel() for p in replica.model.parameters())
            strategy = replica.strategy
            held = sum(p.grad.numel() for p in replica.model.parameters() if p.grad is not None)
            if zero == 2:
                assert held == 0
                chunks = sum(g.numel() for g in strategy.grad_chunks)
                assert numel / world <= chunks <= numel / world + len(strategy.buckets)
            else:
                assert held == numel
            state = sum(v.numel() for s in strategy.optimizer.state.values() for v in s.values() if v.dim())
            assert 2 * numel / world <= state <= 2 * (numel / world + len(strategy.buckets))


def test_a_checkpoint_saved_at_3_workers_resumes_at_2_and_at_4():
    task, config = TINY_GPT_TASK, dataclasses.replace(TINY_GPT_TASK.defaults, zero=2, bucket_mb=0.002)
    initial = initial_weights(task, config.seed)
    uninterrupted, _, _ = train(task, dataclasses.replace(config, zero=0), 1, range(6), initial)
    _, parts, _ = train(task, config, 3, range(3), initial)
    saved = merge_parts(parts)
    assert saved.step == 3 and saved.model
    assert {k.rpartition("/")[2] for k in saved.optimizer_tensors} == {"exp_avg", "exp_avg_sq", "step"}
    for world in (2, 4):
        resumed, _, _ = train(task, config, world, range(3, 6), None, start=saved)
        assert max_abs_diff(resumed, uninterrupted) < TOL, world
    stage0, _, _ = train(task, dataclasses.replace(config, zero=0), 2, range(3, 6), None, start=saved)
    assert max_abs_diff(stage0, uninterrupted) < TOL



@pytest.mark.parametrize("zero", [1, 2])
def test_the_forward_waits_for_the_all_gather_of_every_bucket_it_reads(zero, monkeypatch):
    """The all-gathers' data is made to land only when each is waited for (in a scratch
    copy until then), so a forward that read a parameter before waiting for its bucket
    would train on the last step's weights: the run must still end on stage 0's."""
    from elastic_dp.comm.group import CollectiveGroup

    real = CollectiveGroup.all_gather_async

    def late(self, output, input):
        n, flat = input.numel(), output.view(-1)
        scratch = flat.clone()
        work = real(self, scratch, scratch[self.rank * n:(self.rank + 1) * n])

        class Late:
            def wait(self_, *args):
                work.wait(*args)
                flat.copy_(scratch)
                return True

        return Late()

    monkeypatch.setattr(CollectiveGroup, "all_gather_async", late)
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=4, bucket_mb=0.002)  # several buckets
    initial = initial_weights(task, config.seed)
    sharded, _, replicas = train(task, dataclasses.replace(config, zero=zero), 2, range(4), initial)
    assert all(r.strategy.defer_gather for r in replicas)  # the gathers were left to the forward
    monkeypatch.undo()
    reference, _, _ = train(task, config, 2, range(4), initial)
    assert max_abs_diff(sharded, reference) < TOL


def test_the_forwards_wait_for_its_parameters_is_timed_apart_from_its_compute():
    """Rank 0's all-gathers left in flight by step 1's update take 0.2 s longer to arrive:
    step 2's forward waits for them, and the step's timings say so (``parameter_wait_s``),
    not ``compute_s``."""
    task = MLP_TASK
    config = dataclasses.replace(task.defaults, zero=2)
    initial = initial_weights(task, config.seed)
    sampler = ElasticSampler(len(task.dataset()), global_batch=config.global_batch, seed=config.seed)

    class Late:
        def __init__(self, work):
            self.work = work

        def wait(self, *args):
            time.sleep(0.2)
            return self.work.wait(*args)

    def rank_fn(group):
        replica = Replica(task, config, CPU, group)
        program = SyncProgram(replica)
        replica.model.load_state_dict(initial)
        replica.broadcast_state(0)
        results = []
        for step in range(3):
            gathers = replica.strategy._gathers
            if step == 2 and group.rank == 0:
                assert gathers  # in flight since step 1's update
                gathers.update({b: Late(work) for b, work in gathers.items()})
            results.append(program.step(step, split(sampler.batch(step), 2)[group.rank]))
        return results

    results = run_ranks(2, rank_fn)[0]
    assert all(r.committed for r in results)
    assert results[2].timings["parameter_wait_s"] >= 0.2 > results[2].timings["compute_s"]
    assert results[1].timings["parameter_wait_s"] < 0.2


def test_bf16_parameters_keep_fp32_master_weights_in_the_shard():
    def bf16_mlp():
        return mlp().to(torch.bfloat16)

    def adam(model):
        return torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)

    task = Task(model=bf16_mlp, dataset=Regression, loss=loss, optimizer=adam)
    config = TrainConfig(global_batch=8, zero=1, seed=1)
    initial = initial_weights(task, config.seed)
    final, parts, replicas = train(task, config, 2, range(5), initial)
    masters = replicas[0].strategy.masters
    assert all(m.dtype == torch.float32 for m in masters)
    # a 1e-3 Adam step is below bf16's resolution for most weights: only an fp32 master
    # accumulates them, so the fp32 masters must differ from the bf16 parameters
    merged = merge_parts(parts)
    master_w = merged.optimizer_tensors["0.weight/master"]
    assert master_w.dtype == torch.float32
    assert float((master_w - final["0.weight"].float()).abs().max()) > 0
    torch.testing.assert_close(master_w.to(torch.bfloat16), final["0.weight"])


@pytest.mark.parametrize("zero", [1, 2])
def test_a_peer_lost_after_the_vote_fails_the_norm_all_reduce_in_the_result(zero):
    """Stages 1 and 2 all-reduce the gradient norm after the commit vote. A peer lost there (rank
    1 aborts its group instead of joining that all-reduce) fails rank 0's step as a
    CollectiveError in its result, not as an exception out of the step (which ended the
    worker's window and lost its reports of the steps committed before), and before its
    optimizer step: its chunk still holds step 1's state, which the recovery reads."""
    task = TINY_GPT_TASK  # clip_grad_norm=1.0
    config = dataclasses.replace(task.defaults, zero=zero)
    initial = initial_weights(task, config.seed)
    sampler = ElasticSampler(len(task.dataset()), global_batch=config.global_batch, seed=config.seed)

    def rank_fn(group):
        replica = Replica(task, config, CPU, group)
        program = SyncProgram(replica)
        replica.model.load_state_dict(initial)
        replica.broadcast_state(0)
        assert program.step(0, split(sampler.batch(0), 2)[group.rank]).committed
        if group.rank == 1:
            def lost(max_norm):
                group.abort()
                raise RuntimeError("rank 1 is gone")

            replica.strategy.clip_grad_norm = lost
            with pytest.raises(RuntimeError, match="rank 1 is gone"):
                program.step(1, split(sampler.batch(1), 2)[1])
            return None
        before = {k: v.clone() for k, v in replica.model_state().items()}
        result = program.step(1, split(sampler.batch(1), 2)[0])
        return result, replica.strategy.holdings()["live"], before, replica.model_state()

    result, live, before, after = run_ranks(2, rank_fn)[0]
    assert not result.committed and isinstance(result.error, CollectiveError)
    assert "gradient norm all-reduce" in str(result.error)
    assert live == 1 and max_abs_diff(before, after) == 0.0  # no update applied


@pytest.mark.parametrize("zero", [1, 2])
def test_an_all_gather_that_cannot_start_leaves_the_chunk_updated_whole(zero):
    """Buckets are updated one by one, each starting its all-gather. When the first
    all-gather cannot start (a peer lost), the step fails as a CollectiveError, and yet
    every bucket of the chunk is updated: the chunk is whole at step 2, equal to the chunk
    of a run whose all-gathers went through."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, zero=zero, bucket_mb=0.002)  # several buckets
    initial = initial_weights(task, config.seed)
    sampler = ElasticSampler(len(task.dataset()), global_batch=config.global_batch, seed=config.seed)

    def rank_fn(group, fail: bool):
        replica = Replica(task, config, CPU, group)
        program = SyncProgram(replica)
        replica.model.load_state_dict(initial)
        replica.broadcast_state(0)
        assert program.step(0, split(sampler.batch(0), 2)[group.rank]).committed
        if fail:
            def lost(output, input):
                raise RuntimeError("Connection closed by peer")

            group.all_gather_async = lost
        result = program.step(1, split(sampler.batch(1), 2)[group.rank])
        return result, replica.strategy.export("live", 2)

    reference = run_ranks(2, lambda group: rank_fn(group, False))
    failed = run_ranks(2, lambda group: rank_fn(group, True))
    assert len(failed[0][1].master) > 2
    for (ok, whole), (result, chunk) in zip(reference, failed):
        assert ok.committed and not result.committed and isinstance(result.error, CollectiveError)
        assert "parameter all-gather" in str(result.error)
        assert all(torch.equal(x, y) for x, y in zip(whole.master, chunk.master))
        assert all(torch.equal(x, y) for k in whole.state for x, y in zip(whole.state[k], chunk.state[k]))


def test_non_elementwise_optimizer_is_refused_with_zero():
    task = dataclasses.replace(MLP_TASK, optimizer=lambda m: torch.optim.LBFGS(m.parameters()))
    with pytest.raises(ConfigError, match=r"TrainConfig\.zero=1 .*LBFGS.*TrainConfig\.zero=0"):
        Replica(task, TrainConfig(zero=1), CPU, group=None)
    Replica(task, TrainConfig(zero=0), CPU, group=None)  # fine without sharding


@pytest.mark.parametrize("stage", [4, -1, "1"])
def test_unknown_stage_is_refused(stage):
    with pytest.raises(ConfigError, match=r"TrainConfig\.zero"):
        TrainConfig(zero=stage)


@pytest.mark.parametrize("zero", [1, 2])
def test_gloo_with_cuda_tensors_stages_every_call_through_host_copies(monkeypatch, zero):
    """Workers that share a GPU talk through gloo, which takes CUDA tensors only by way of
    host copies (collective._Staged). No GPU here: every tensor is taken for one, so each
    all-reduce, reduce-scatter, all-gather, broadcast and snapshot exchange of a ZeRO run
    goes through the copies and their copy back; it must still end on stage 0's parameters."""
    from elastic_dp.comm import group as collective

    staged = []

    def staging(self, tensor):
        staged.append(tensor.numel())
        return True

    monkeypatch.setattr(collective.CollectiveGroup, "_staging", staging)
    config = dataclasses.replace(MLP_TASK.defaults, steps=5, bucket_mb=0.0001)
    initial = initial_weights(MLP_TASK, config.seed)
    sharded, _, _ = train(MLP_TASK, dataclasses.replace(config, zero=zero), 2, range(5), initial)
    assert staged
    monkeypatch.undo()
    reference, _, _ = train(MLP_TASK, config, 2, range(5), initial)
    assert max_abs_diff(sharded, reference) < TOL



def test_the_old_ranks_a_new_rank_reads_are_those_whose_chunks_overlap_its_own():
    """``chunks.sources`` against the closed form, every old rank's range checked, for
    shrinks, growths and uneven buckets."""
    from elastic_dp.state.zero.chunks import chunk_sizes, sources

    numels = [1, 7, 100, 1023, 4096 + 3]
    for world, old_world in [(1, 3), (2, 3), (3, 2), (4, 7), (7, 4), (5, 5), (16, 3)]:
        for rank in range(world):
            expected = set()
            for chunk, old in zip(chunk_sizes(numels, world), chunk_sizes(numels, old_world)):
                lo, hi = rank * chunk, (rank + 1) * chunk
                expected |= {i for i in range(old_world) if i * old < hi and (i + 1) * old > lo}
            assert sources(rank, numels, world, old_world) == (sorted(expected) or [0]), (rank, world, old_world)
