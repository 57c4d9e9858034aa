"""Models with buffers on Ray: a CNN with BatchNorm2d and BatchNorm1d through a kill and a
join. Its running statistics are part of the atomic step (``num_batches_tracked`` equals
the steps), the replicas agree on them (the final weights, rank 0's, equal the checkpoint
each rank wrote its range of), and with ``--batch-stats global`` the run ends on the plain
one-process replay at any worker count, parameters and running statistics alike."""

from __future__ import annotations

import dataclasses

import pytest
from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ElasticSampler
from elastic_dp.durable.checkpoint import CheckpointStore
from tests.records import read_lines
from tests.reference import max_abs_diff, replay, replay_updates
from tests.runs import fit
from tests.tasks import CNN_TASK, POISONED_CNN_TASK, KillsAt

pytestmark = pytest.mark.ray

TOL = 1e-5  # float32 reduction order
# worst measured 9.5e-07 (4 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 11x margin
"""SGD over 10 steps in float32: the statistics and the gradients are summed in another
order than the replay's one forward (measured: at most 1e-6 at 2 and 3 workers, stages 0
and 2), while the same run at 3 workers with ``--batch-stats local`` ends 1.7 away."""

BN_COUNTERS = ("1.num_batches_tracked", "5.num_batches_tracked")


def _fit(tmp_path, config, workers: int, inject: list[str], checkpoint: CheckpointConfig | None = None,
         task=CNN_TASK):
    run = fit(task, tmp_path, workers=workers, min_workers=1, inject=inject, checkpoint=checkpoint, config=config)
    return run.weights(), run.changes()


def test_local_statistics_through_a_kill_and_a_join_count_each_step_once_and_agree(ray_cluster, tmp_path, caplog):
    """Stage 0, 3 workers, a worker killed in step 3 (whose forward the survivors had run)
    and one joining at step 6. The run says at start which modules make it depend on the
    worker count."""
    config = CNN_TASK.defaults
    final, changes = _fit(tmp_path, config, 3, ["kill:step=3:rank=1", "join:step=6"],
                          CheckpointConfig(dir=str(tmp_path / "ckpt"), every=10))
    assert "--batch-stats local: the batch-norm modules 1, 5 normalise over each worker's slice" in caplog.text
    assert sum(e["lost"] for e in changes) == 1 and sum(e.get("joined", 0) for e in changes) >= 1
    assert [int(final[k]) for k in BN_COUNTERS] == [10, 10]
    saved = CheckpointStore(str(tmp_path / "ckpt")).latest()
    assert saved.step == 10 and saved.world_size == changes[-1]["world_size"] >= 2
    assert max_abs_diff(saved.read().model, final) == 0.0, "each rank's range of the buffers is rank 0's"
    initial = load_file(tmp_path / "initial.safetensors")
    assert float((final["1.running_mean"] - initial["1.running_mean"]).abs().max()) > 1e-2


@pytest.mark.parametrize(("workers", "inject"), [(1, []), (3, ["kill:step=3:rank=1", "join:step=6"])])
def test_global_statistics_end_on_the_replay_at_any_worker_count(ray_cluster, tmp_path, workers, inject):
    """ZeRO-2 (a rollback to peer snapshots after the kill): one worker, or three with a
    kill and a join, so that the steps run at two or three worker counts (a worker that is
    late to start joins at a step boundary)."""
    config = dataclasses.replace(CNN_TASK.defaults, batch_stats="global", zero=2)
    final, changes = _fit(tmp_path, config, workers, inject)
    assert sum(e["lost"] for e in changes) == len(inject) // 2
    sizes = {m["world_size"] for m in read_lines(tmp_path / "metrics.jsonl")}
    assert sizes == {1} if workers == 1 else len(sizes) >= 2
    expected = replay(CNN_TASK, config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(final, expected) < TOL
    assert [int(final[k]) for k in BN_COUNTERS] == [10, 10]
    assert max_abs_diff(final, load_file(tmp_path / "initial.safetensors")) > 1e-2, "training moved the model"


def test_global_statistics_with_a_micro_batch_that_splits_no_slice_end_on_the_replay(ray_cluster, tmp_path):
    """A job whose defaults set a micro-batch (as the README's example does), with
    ``--batch-stats global``: 3 workers, at least 2, micro-batches of 6, so that every slice
    (4 samples at 3 workers, 6 at 2) is one forward; through a kill and a join."""
    config = dataclasses.replace(CNN_TASK.defaults, batch_stats="global", micro_batch=6)
    run = fit(CNN_TASK, tmp_path, workers=3, min_workers=2, inject=["kill:step=3:rank=1", "join:step=6"],
              config=config)
    assert {m["world_size"] for m in read_lines(tmp_path / "metrics.jsonl")} >= {2, 3}
    expected = replay(CNN_TASK, config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(run.weights(), expected) < TOL
    assert [int(run.weights()[k]) for k in BN_COUNTERS] == [10, 10]


def test_async_updates_add_their_forward_s_change_and_a_skipped_or_lost_one_leaves_none(ray_cluster, tmp_path):
    """``--mode async``, 2 workers, staleness up to 2: step 2's sample is NaN, so its
    forward made the running statistics NaN and its update is skipped as a no-op (and
    said: the ``nonfinite_step`` event); the worker that computes step 5 is SIGKILLed as it
    reads the step's first sample (whichever worker leases it: an injected kill of one
    rank fires only if that rank leases a step from 5 on, which under load it may not).
    The buffers are shard 0's: each applied update adds what its forward changed in the
    buffers of the version it pulled, so the run ends on the replay of updates.jsonl,
    running statistics included, and they count the 9 applied updates."""
    config = dataclasses.replace(POISONED_CNN_TASK.defaults, mode="async", max_staleness=2)
    first_of_step_5 = int(ElasticSampler(120, global_batch=config.global_batch, seed=config.seed).batch(5)[0])
    killing = dataclasses.replace(POISONED_CNN_TASK, dataset=KillsAt(POISONED_CNN_TASK.dataset, first_of_step_5,
                                                                       str(tmp_path / "killed")))
    final, changes = _fit(tmp_path, config, 2, [], task=killing)
    assert (tmp_path / "killed").exists()
    assert sum(e["lost"] for e in changes) == 1
    updates = {u["version"]: u for u in read_lines(tmp_path / "updates.jsonl")}
    assert sorted(updates) == list(range(1, 11))
    (version,) = [v for v, u in updates.items() if u["step"] == 2]
    assert [m["step"] for m in read_lines(tmp_path / "metrics.jsonl") if m.get("nonfinite")] == [version - 1]
    (skipped,) = [e for e in read_lines(tmp_path / "events.jsonl") if e["kind"] == "nonfinite_step"]
    assert (skipped["update"], skipped["sampler_step"], skipped["action"]) == (version, 2, "skipped")
    assert [int(final[k]) for k in BN_COUNTERS] == [9, 9]
    assert all(bool(v.isfinite().all()) for v in final.values())
    expected = replay_updates(POISONED_CNN_TASK, config, str(tmp_path / "initial.safetensors"), list(updates.values()))
    assert max_abs_diff(final, expected) < TOL
