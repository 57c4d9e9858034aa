"""ZeRO runs on gloo ranks run as threads (no Ray), for tests/test_zero*.py: a task's
initial weights, training a few steps on every rank, and the largest difference of two
weight sets."""

from __future__ import annotations

import dataclasses

import torch

from elastic_dp import ElasticSampler, Task, TrainConfig
from elastic_dp.data import rank_slice
from elastic_dp.durable.checkpoint import Checkpoint
from elastic_dp.modes.sync.program import SyncProgram
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks

CPU = torch.device("cpu")


def initial_weights(task: Task, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # built once: the ranks are threads sharing torch's RNG
    return {k: v.clone() for k, v in task.model().state_dict().items()}


def train(task: Task, config: TrainConfig, world: int, steps: range, initial, *, start=None, before_exit=None,
          after_build=None, sizes=None, hosts=None, parts=None):
    """Run ``steps`` on ``world`` thread ranks from ``initial`` weights (or a whole
    TrainingState ``start``, or a Checkpoint ``start`` each rank reads); return rank 0's final weights and every rank's training state.
    ``before_exit(replica)`` runs on each rank after its steps, while its group still exists;
    ``after_build(replica)`` before them; ``sizes``: the ranks' slice sizes (``--balance``'s),
    instead of the equal split; ``hosts``: the host each rank is told it runs on; ``parts``: a dict that
    gets each rank's checkpoint part after the steps, as the sync program writes it (with its
    reduction's row). From ``initial`` weights each rank builds the model whole
    (``--init auto`` is ``whole`` then) and loads them."""
    if start is None and initial is not None and config.init == "auto":
        config = dataclasses.replace(config, init="whole")
    dataset_len = len(task.dataset())
    sampler = ElasticSampler(dataset_len, global_batch=config.global_batch, seed=config.seed)

    def rank_fn(group):
        replica = Replica(task, config, CPU, group)
        program = SyncProgram(replica)
        if after_build is not None:
            after_build(replica)
        if isinstance(start, Checkpoint):
            program.load_checkpoint(start)
        elif start is not None:
            replica.load_state(start)
        else:
            if initial is not None:
                replica.model.load_state_dict(initial)
            replica.broadcast_state(0)
        for step in steps:
            indices = rank_slice(sampler.batch(step), group.world_size, group.rank, sizes)
            result = program.step(step, indices, sizes=sizes)
            assert result.committed, result.error
        state = replica.training_state(steps.stop, {"seed": config.seed})
        if parts is not None:
            parts[group.rank] = program.checkpoint_part(steps.stop, {"seed": config.seed})
        if before_exit is not None:
            before_exit(replica)
        return replica.model_state(), state, replica

    results = run_ranks(world, rank_fn, hosts=hosts)
    return results[0][0], [r[1] for r in results], [r[2] for r in results]
