"""The worker side's seams without Ray: the commit vote as a record that any collective
can carry (or one of its own), the fault hook's phases, and an actor that runs one mode's
program and refuses another's calls."""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest
import torch

from elastic_dp import Fault
from elastic_dp.comm.vote import Ballot, Vote
from elastic_dp.errors import WorkerError
from elastic_dp.faults import FaultHook
from elastic_dp.modes.asyncsgd.program import AsyncProgram
from elastic_dp.modes.registry import make_program
from elastic_dp.modes.sync.program import SyncProgram
from elastic_dp.worker.actor import WorkerActor
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.tasks import MLP_TASK

CPU = torch.device("cpu")


def test_a_ballot_cast_on_its_own_collective_gives_every_rank_the_tally():
    """A mode whose step makes no gradient reduction can still commit: each rank's ballot
    summed in its own all-reduce is the tally of the three ranks, on every rank."""
    def rank_fn(group):
        ballot = Ballot(CPU)
        if group.rank == 1:
            ballot.error()
        if group.rank in (0, 2):
            ballot.nonfinite(torch.tensor(True))  # as the reducer adds it, on the device
        if group.rank == 2:
            ballot.stop()
        return ballot.cast(group), ballot.alone()

    for rank, (vote, alone) in enumerate(run_ranks(3, rank_fn)):
        assert vote == Vote(errors=1, nonfinite=2, stops=1)
        assert not vote.commits and not vote.updates and vote.stop
        assert alone == Vote(errors=int(rank == 1), nonfinite=int(rank in (0, 2)), stops=int(rank == 2))


def test_a_clean_vote_commits_and_updates_and_a_nonfinite_one_commits_as_a_no_op():
    assert Vote().commits and Vote().updates and not Vote().stop
    assert Vote(nonfinite=1).commits and not Vote(nonfinite=1).updates
    assert Vote.of(torch.tensor([0.0, 3.0, 2.0])) == Vote(nonfinite=3, stops=2)


def test_an_armed_fault_fires_once_at_its_phase_and_a_step_s_unfired_one_is_disarmed(monkeypatch):
    fired = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: fired.append(sig))
    hook = FaultHook()
    hook.arm(Fault.parse("kill:step=3:rank=0:phase=optimizer"), None, Fault.parse("hang:step=3:rank=0:phase=upload"))
    hook.at("forward")
    assert fired == []  # not its phase
    hook.at("optimizer")
    hook.at("optimizer")
    assert fired == [signal.SIGKILL]  # once
    hook.arm(Fault.parse("kill:step=4:rank=0:phase=allreduce"))
    hook.disarm()  # the step ended before its vote left
    hook.at("allreduce")
    assert fired == [signal.SIGKILL]
    hook.at("upload")  # not a step phase: still armed
    assert fired == [signal.SIGKILL, signal.SIGSTOP]


def test_a_step_that_fails_before_its_fault_s_phase_leaves_nothing_armed(monkeypatch):
    """A fault of phase optimizer in a step whose forward raised does not fire in the next."""
    fired = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: fired.append(sig))
    broken = {"on": True}

    def loss(model, batch):
        if broken["on"]:
            raise RuntimeError("the task's loss failed")
        return MLP_TASK.loss(model, batch)

    task = dataclasses.replace(MLP_TASK, loss=loss)

    def rank_fn(group):
        program = SyncProgram(Replica(task, MLP_TASK.defaults, CPU, group))
        program.replica.broadcast_state(0)
        program.replica.faults.arm(Fault.parse("kill:step=0:rank=0:phase=optimizer"))  # as the actor does
        failed = program.step(0, np.arange(4))
        broken["on"] = False
        return failed, program.step(0, np.arange(4))

    ((failed, again),) = run_ranks(1, rank_fn)
    assert not failed.committed and "the task's loss failed" in str(failed.error)
    assert again.committed and fired == []


def _actor(mode: str) -> WorkerActor:
    actor = WorkerActor(device="cpu", backend="gloo", num_threads=1, collective_timeout_s=5)
    config = dataclasses.replace(MLP_TASK.defaults, mode=mode)
    actor.replica = Replica(MLP_TASK, config, CPU, actor.group, actor.faults)
    actor.program = make_program(actor.replica)  # as setup builds it
    return actor


def test_an_async_worker_refuses_the_synchronous_calls_naming_both_modes():
    actor = _actor("async")
    assert isinstance(actor.program, AsyncProgram)
    with pytest.raises(WorkerError, match=r"run_window is a call of TrainConfig\.mode='sync', and this worker runs "
                                          r"TrainConfig\.mode='async'"):
        next(iter(actor.stream("run_window", None)))
    with pytest.raises(WorkerError, match=r"grant is a call of TrainConfig\.mode='sync'"):
        actor.call("grant", 0, 1, True, {})
    with pytest.raises(WorkerError, match=r"window is a call of TrainConfig\.mode='diloco'"):
        actor.call("window", 0, 1, {}, {})
    with pytest.raises(WorkerError, match=r"import_chunks moves ZeRO chunks.*TrainConfig\.zero=0"):
        actor.import_chunks([], 1, 0)


def test_a_sync_worker_refuses_the_asynchronous_gradient_and_a_call_no_program_has():
    actor = _actor("sync")
    assert isinstance(actor.program, SyncProgram)
    with pytest.raises(WorkerError, match=r"gradient is a call of TrainConfig\.mode='async', and this worker "
                                          r"runs TrainConfig\.mode='sync'"):
        actor.call("gradient", 0, {"seed": 0, "global_batch": 4, "dataset_len": 96}, [0, 1], None, None)
    with pytest.raises(WorkerError, match=r"grant of TrainConfig\.mode='sync' is a call, asked for as a stream"):
        next(iter(actor.stream("grant", 0, 1, True, {})))
    with pytest.raises(WorkerError, match=r"no training mode's program has a call step"):
        actor.call("step", 0, [0])  # the program's own method, not one of its calls
