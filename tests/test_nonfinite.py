"""A non-finite loss or gradient never reaches the weights: the step is skipped on every
rank alike (the commit vote carries the flag) and the run goes on, or fails naming the
step and the rank. The reference replay (tests.reference) treats such a step as a no-op,
the documented semantics; the tolerance is the suite's float32 one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from elastic_dp import ClusterConfig, NonFiniteError, Trainer, split
from elastic_dp.data import ElasticSampler
from elastic_dp.messages import StepResult
from elastic_dp.modes.guard import NonFiniteGuard
from elastic_dp.modes.sync.program import SyncProgram
from elastic_dp.observe.metrics import RunRecorder
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.tasks import POISONED, POISONED_TASK, TWICE_POISONED_TASK

TOL = 2e-5  # float32 reduction order
# worst measured 6.0e-08 (4 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 333x margin
CPU = torch.device("cpu")


@pytest.mark.parametrize("zero", [0, 2])
def test_every_rank_skips_the_update_of_a_step_with_a_nan_loss(zero):
    config = dataclasses.replace(POISONED_TASK.defaults, zero=zero)
    sampler = ElasticSampler(96, global_batch=config.global_batch, seed=config.seed)
    assert POISONED in split(sampler.batch(3), 2)[0]

    def rank_fn(group):
        replica = Replica(POISONED_TASK, config, CPU, group)
        program = SyncProgram(replica)
        replica.broadcast_state(0)
        for step in range(3):
            assert program.step(step, split(sampler.batch(step), 2)[group.rank]).committed
        before = replica.model_state(), replica.training_state(3, {})
        result = program.step(3, split(sampler.batch(3), 2)[group.rank])
        after = replica.model_state(), replica.training_state(4, {})
        return result, before, after, replica

    for rank, (result, (params, before), (params_after, after), replica) in enumerate(run_ranks(2, rank_fn)):
        assert result.committed and result.nonfinite and result.error is None
        assert result.loss_finite is (rank != 0)
        assert max_abs_diff(params, params_after) == 0.0
        assert before.optimizer_tensors.keys() == after.optimizer_tensors.keys()
        assert all(torch.equal(before.optimizer_tensors[k], after.optimizer_tensors[k])
                   for k in before.optimizer_tensors)  # momentum (and step counts) did not move
        if zero:
            assert replica.strategy.holdings()["live"] == 4  # the chunk is the state of step 4


@pytest.mark.parametrize("zero", [0, 2])
def test_a_nan_sample_is_skipped_and_the_run_ends_on_the_replay(ray_cluster, tmp_path, zero):
    config = dataclasses.replace(POISONED_TASK.defaults, zero=zero)
    summary = Trainer(POISONED_TASK, train=config, cluster=ClusterConfig(workers=2), out_dir=str(tmp_path),
                      progress=False).fit()
    final = load_file(tmp_path / "final.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in final.values())
    assert max_abs_diff(final, replay(POISONED_TASK, config, str(tmp_path / "initial.safetensors"))) < TOL
    metrics = read_lines(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(8))
    assert [m["step"] for m in metrics if m.get("nonfinite")] == [3] and metrics[3]["loss"] is None
    events = read_lines(tmp_path / "events.jsonl")
    skipped = [e for e in events if e["kind"] == "nonfinite_step"]
    assert len(skipped) == 1 and skipped[0]["step"] == 3 and skipped[0]["loss_ranks"] == [0]
    assert summary.steps == 8 and summary.samples == 8 * config.global_batch


def test_on_nonfinite_fail_ends_the_run_naming_the_step_and_the_rank(ray_cluster, tmp_path):
    config = dataclasses.replace(POISONED_TASK.defaults, on_nonfinite="fail")
    with pytest.raises(NonFiniteError, match=r"step 3: the loss was not finite on rank 0.*TrainConfig\.on_nonfinite='skip'"):
        Trainer(POISONED_TASK, train=config, cluster=ClusterConfig(workers=2), out_dir=str(tmp_path),
                progress=False).fit()
    assert not (tmp_path / "final.safetensors").exists()


def test_async_on_nonfinite_fail_ends_the_run_naming_the_update_the_worker_and_the_setting(ray_cluster, tmp_path):
    config = dataclasses.replace(POISONED_TASK.defaults, mode="async", max_staleness=0, on_nonfinite="fail")
    with pytest.raises(NonFiniteError, match=r"update 4 \(the gradient of sampler step 3 by worker-\d+\): the loss "
                                             r"was not finite.*TrainConfig\.on_nonfinite='fail'.*"
                                             r"TrainConfig\.on_nonfinite='skip'"):
        Trainer(POISONED_TASK, train=config, cluster=ClusterConfig(workers=1), out_dir=str(tmp_path),
                progress=False).fit()
    assert not (tmp_path / "final.safetensors").exists()


def test_async_consecutive_nan_updates_beyond_the_limit_fail_naming_the_setting(ray_cluster, tmp_path):
    config = dataclasses.replace(TWICE_POISONED_TASK.defaults, mode="async", max_staleness=0, max_nonfinite_steps=2)
    with pytest.raises(NonFiniteError, match=r"2 consecutive updates \(4\.\.5\).*TrainConfig\.max_nonfinite_steps is 2"):
        Trainer(TWICE_POISONED_TASK, train=config, cluster=ClusterConfig(workers=1), out_dir=str(tmp_path),
                progress=False).fit()


def _results(nonfinite: bool, loss_ranks=()) -> list[StepResult]:
    return [StepResult(step=0, rank=r, generation=0, committed=True, nonfinite=nonfinite,
                       loss_finite=r not in loss_ranks) for r in range(2)]


def test_consecutive_skips_beyond_the_limit_fail_naming_the_setting():
    guard = NonFiniteGuard("skip", 3, RunRecorder(None, total_steps=10, progress=False))
    assert guard.check(0, _results(True, [1])) and guard.check(1, _results(True))
    assert not guard.check(2, _results(False)) and guard.consecutive == 0  # a clean step resets the count
    assert guard.check(3, _results(True)) and guard.check(4, _results(True))
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps \(3\.\.5\).*gradient was not finite.*"
                                             r"TrainConfig\.max_nonfinite_steps is 3"):
        guard.check(5, _results(True))
    events = guard.recorder.summary.events
    assert [e["step"] for e in events] == [0, 1, 3, 4, 5] and events[0]["loss_ranks"] == [1]
