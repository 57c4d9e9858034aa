"""Models with buffers, without Ray: batch-norm statistics over the global batch on gloo
ranks (``comm.batchnorm``) against one forward of the whole batch in plain torch; a rank
that fails completes the step's collectives; the buffers' save, restore and agreement
(``state.buffers``), and the ballot that carries them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from elastic_dp.comm.batchnorm import GlobalBatchStats
from elastic_dp.comm.vote import Ballot
from elastic_dp.config import TrainConfig
from elastic_dp.errors import ConfigError
from elastic_dp.state.buffers import ModelBuffers
from tests.ranks import run_ranks
from tests.tasks import CNN_TASK

B = 12


def _batch(indices) -> tuple[torch.Tensor, torch.Tensor]:
    return CNN_TASK.collate([CNN_TASK.dataset()[int(i)] for i in indices])


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = CNN_TASK.model()
    with torch.no_grad():  # running statistics away from their initial values, to see them move
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return model.state_dict()


INITIAL = _initial()


def _model() -> torch.nn.Module:
    """The same model on every rank (built without the global RNG, which the ranks' threads share)."""
    model = CNN_TASK.model()
    model.load_state_dict(INITIAL)
    return model


def _reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain torch: one forward of the whole batch per step."""
    model = _model()
    losses = []
    for step in range(steps):
        model.zero_grad()
        loss = CNN_TASK.loss(model, _batch(range(step * B, (step + 1) * B)))
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, model.state_dict()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_global_statistics_over_the_slices_equal_one_forward_of_the_whole_batch(world):
    """Two steps on uneven slices (5, 4, 3 at three ranks): the loss summed over the ranks,
    the gradients summed over the ranks and the running statistics equal plain torch's
    over the whole batch, to float32 rounding (1e-5: the statistics are combined in
    another order than torch's one pass)."""
    sizes = {1: [12], 2: [7, 5], 3: [5, 4, 3]}[world]
    bounds = np.cumsum([0, *sizes])

    def rank_fn(group):
        model = _model()
        stats = GlobalBatchStats(model, group)
        losses = []
        for step in range(2):
            model.zero_grad()
            stats.begin_step()
            lo, hi = step * B + bounds[group.rank], step * B + bounds[group.rank + 1]
            loss = CNN_TASK.loss(model, _batch(range(lo, hi))) * ((hi - lo) / B)
            loss.backward()
            stats.complete_step()
            losses.append(group.all_reduce(loss.detach().clone()).item())
        grads = {n: group.all_reduce(p.grad.clone()) for n, p in model.named_parameters()}
        return losses, grads, model.state_dict()

    losses, grads, state = _reference(2)
    for got_losses, got_grads, got_state in run_ranks(world, rank_fn, side=True):
        assert got_losses == pytest.approx(losses, rel=1e-5)
        for name in grads:
            assert torch.allclose(got_grads[name], grads[name], atol=1e-5), name  # measured 1.5e-7 (3 runs)
        for name in state:
            assert torch.allclose(got_state[name].double(), state[name].double(), atol=1e-5), name  # 6.0e-8
        assert int(got_state["1.num_batches_tracked"]) == 2


def test_a_rank_whose_forward_failed_or_has_no_sample_completes_the_collectives():
    """Rank 1's forward raises before its first batch-norm module and rank 2 has no sample:
    both make the step's collectives with nothing in them, so rank 0 is not left waiting
    (the group's timeout is 30 s) and normalises over its own samples alone."""
    def rank_fn(group):
        model = _model()
        stats = GlobalBatchStats(model, group)
        stats.begin_step()
        if group.rank == 0:
            CNN_TASK.loss(model, _batch(range(6))).backward()
        stats.complete_step()
        return model.state_dict()

    alone = _model()
    CNN_TASK.loss(alone, _batch(range(6))).backward()
    states = run_ranks(3, rank_fn, side=True)
    for name, value in alone.state_dict().items():
        assert torch.allclose(states[0][name], value, atol=1e-6), name  # measured 3.0e-8 (3 runs)


def test_a_saved_step_restores_and_the_ranks_agree_on_the_sample_weighted_mean():
    """Buffers changed by a forward are put back by restore; after a committed step each
    rank's buffers, weighted by its share, travel as the ballot's payload and every rank
    takes their mean: running statistics averaged, counts rounded, and a buffer equal on
    every rank (BatchNorm1d's running variance here, which no rank changed) stays bit for
    bit what it was."""
    shares = [5 / 12, 4 / 12, 3 / 12]

    def rank_fn(group):
        model = _model()
        buffers = ModelBuffers(model)
        before = buffers.copy()
        buffers.save()
        model(_batch(range(4))[0])
        assert not torch.equal(model.state_dict()["1.running_mean"], before["1.running_mean"])
        buffers.restore()
        assert all(torch.equal(model.state_dict()[n], v) for n, v in before.items())
        with torch.no_grad():
            model[1].running_mean.fill_(group.rank + 1)
            model[1].num_batches_tracked.fill_(7)
        ballot = Ballot()
        ballot.payload = buffers.payload(shares[group.rank])
        buffers.agree(ballot.cast(group).payload)
        return model.state_dict(), before

    for state, before in run_ranks(3, rank_fn):
        assert torch.allclose(state["1.running_mean"], torch.full((4,), 5 / 12 + 8 / 12 + 9 / 12))
        assert int(state["1.num_batches_tracked"]) == 7 and state["1.num_batches_tracked"].dtype == torch.int64
        assert torch.equal(state["5.running_var"], before["5.running_var"])  # equal everywhere: exactly kept


def test_global_statistics_refuse_a_micro_batch_that_splits_a_slice_and_async_naming_the_settings():
    """In the Python API's words (the command's flags: tests/test_errors.py). A micro-batch
    is refused only where it would split a slice at the fewest workers: 12 samples over at
    least 2 workers make slices of at most 6."""
    from elastic_dp import ClusterConfig, Trainer

    def trainer(micro_batch, min_workers, balance=False):
        train = dataclasses.replace(CNN_TASK.defaults, batch_stats="global", micro_batch=micro_batch, balance=balance)
        return Trainer(CNN_TASK, train=train, cluster=ClusterConfig(workers=3, min_workers=min_workers))

    trainer(6, 2), trainer(4, 3), trainer(12, 1)  # accepted: no slice is split
    with pytest.raises(ConfigError, match=r"TrainConfig.batch_stats='global' computes .* TrainConfig.micro_batch=5 "
                                          r"would split a slice: at 2 workers \(MIN of ClusterConfig\(min_workers=MIN, "
                                          r"workers=MAX\)\) a worker's slice of the global batch 12 is up to 6 samples: "
                                          r"raise TrainConfig.micro_batch to 6"):
        trainer(5, 2)
    with pytest.raises(ConfigError, match=r"is up to 11 samples \(with TrainConfig\(balance=True\)\)"):
        trainer(6, 2, balance=True)
    with pytest.raises(ConfigError, match=r"TrainConfig.batch_stats is read only with TrainConfig.mode='sync', and "
                                          r"this run is TrainConfig.mode='async'"):
        TrainConfig(batch_stats="global", mode="async")
    with pytest.raises(ConfigError, match=r"batch_stats must be one of local, global, got 'mean' "
                                          r"\(TrainConfig.batch_stats\)"):
        TrainConfig(batch_stats="mean")
