"""The worker's own step loop without Ray (elastic_dp.modes.sync.grants, SyncProgram.run_window), on gloo
ranks run as threads: a request to stop, heard by one rank only, ends every rank's
window after the same step, through the commit vote; grants name their window."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from safetensors.torch import save_file

from elastic_dp import Task
from elastic_dp.faults import Fault
from elastic_dp.messages import WindowPlan
from elastic_dp.modes.sync.grants import Grants
from elastic_dp.modes.sync.program import SyncProgram
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.reference import max_abs_diff, replay
from tests.tasks import MLP_TASK, Regression, mlp, mse, sgd_two_groups

TOL = 2e-5  # SGD on the MLP: float32 reduction order only (as in test_windows)
# worst measured 3.0e-08 (4 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 667x margin
UNTIL = 400  # the grant: far past the step at which the window stops


@pytest.mark.parametrize("zero", [0, 2])
@pytest.mark.parametrize("heard_in", ["forward", "update"])
def test_a_stop_heard_by_one_rank_ends_every_ranks_window_after_the_same_step(tmp_path, zero, heard_in):
    """Rank 1 alone is asked to stop in step 3: during its forward, before the step's vote
    leaves, so step 3's vote carries it; or during its update, after the vote left, so
    step 4's does. Every rank ends its window after that step, though 400 steps were
    granted, and the parameters are those of as many steps of the plain replay."""
    local = threading.local()
    heard_at = 3
    last = heard_at if heard_in == "forward" else heard_at + 1

    def hear(step):
        if local.rank == 1 and step == heard_at:
            local.program.grants.extend(1, UNTIL, True, {}, stop=True)  # what the control thread does

    def loss(model, batch):
        if heard_in == "forward":
            hear(local.step)
        return mse(model, batch)

    task = Task(model=mlp, dataset=Regression, loss=loss, optimizer=sgd_two_groups, defaults=MLP_TASK.defaults)
    config = dataclasses.replace(MLP_TASK.defaults, zero=zero)
    torch.manual_seed(config.seed)
    initial = {k: v.clone() for k, v in mlp().state_dict().items()}  # once: the ranks share one RNG
    save_file(initial, str(tmp_path / "initial.safetensors"))
    sampler = {"seed": config.seed, "global_batch": config.global_batch, "dataset_len": len(Regression())}

    def rank_fn(group):
        replica = Replica(task, config, torch.device("cpu"), group)
        program = SyncProgram(replica)
        replica.model.load_state_dict(initial)
        replica.broadcast_state(0)
        local.rank, local.program = group.rank, program
        results = []
        original_step, original_update = program.step, replica.strategy.optimizer_step

        def counted(step, *args, **kwargs):
            local.step = step
            return original_step(step, *args, **kwargs)

        def update(step):
            original_update(step)
            if heard_in == "update":
                hear(step)

        program.step, replica.strategy.optimizer_step = counted, update
        for report in program.run_window(WindowPlan(1, 0, UNTIL, True, sampler)):
            results.extend(report)
        return [(r.step, r.committed, r.stop) for r in results], replica.settled_model().state_dict()

    ranks = run_ranks(3, rank_fn)
    for steps, _ in ranks:
        assert steps == [(s, True, s == last) for s in range(last + 1)]
    expected = replay(MLP_TASK, config, str(tmp_path / "initial.safetensors"), steps=last + 1)
    for _, state in ranks:
        assert max_abs_diff({k: v.detach() for k, v in state.items()}, expected) < TOL


def test_grants_name_their_window():
    """A stop or grant of an earlier window is ignored; one that overtakes the start of
    its window is kept for it."""
    grants = Grants()
    sampler = {"seed": 0, "global_batch": 4, "dataset_len": 8}
    grants.extend(2, 20, True, {5: Fault.parse("kill:step=5:rank=0")}, stop=True)  # before window 2 opened
    grants.open(WindowPlan(1, 0, 4, False, sampler))
    assert not grants.stopping() and not grants.granted(4)
    grants.extend(1, 8, False, {})
    assert grants.granted(7) and not grants.granted(8)
    grants.open(WindowPlan(2, 8, 10, False, sampler))
    assert grants.stopping() and grants.granted(19) and grants.fault(5) is not None
    grants.extend(1, 30, True, {}, stop=True)  # late: window 1 is over
    assert not grants.granted(25)
    grants.open(WindowPlan(3, 20, 24, True, sampler))
    assert not grants.stopping()
    grants.extend(3, 24, True, {}, stop=True)
    assert grants.stopping() and grants.wait_for(23) and not grants.wait_for(24)
