"""Worker processes kept from one ``Trainer.fit()`` for the next (``elastic_dp.keep_workers``):
the next run's workers are the same processes, and it ends exactly where the same run on
new processes ends, whatever the run before it did (another task, a ZeRO stage, a module
that keeps state, an environment variable it set, a worker it lost). ``fresh_workers``: the
suite's own kept workers stopped first, so that each test's block is the outermost one and
its runs outside the block start new processes."""

from __future__ import annotations

import os
import time

import torch

import elastic_dp
from tests import stateful_job
from tests.runs import fit
from tests.tasks import TINY_GPT_TASK


def _pids(run) -> list[int]:
    return [e for e in run.events if e["kind"] == "mesh"][-1]["pids"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_next_run_takes_the_kept_processes_and_ends_where_new_ones_end(fresh_workers, tmp_path):
    fresh = fit(stateful_job.TASK, tmp_path / "fresh", workers=2, steps=4)
    with elastic_dp.keep_workers():
        first = fit(TINY_GPT_TASK, tmp_path / "first", workers=2, steps=3, zero=2)
        second = fit(stateful_job.TASK, tmp_path / "second", workers=2, steps=4)
        third = fit(stateful_job.TASK, tmp_path / "third", workers=2, steps=4)  # after the module ran in them
    assert sorted(_pids(second)) == sorted(_pids(first)) == sorted(_pids(third))  # the same two processes
    for run in (second, third):  # bit for bit: the module's counter, its variable, the last run's stage gone
        for name, tensor in fresh.weights().items():
            assert torch.equal(run.weights()[name], tensor), name
    deadline = time.monotonic() + 10  # the block's end stopped them (Ray ends a killed actor's process soon after)
    while any(_alive(pid) for pid in _pids(third)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in _pids(third))


def test_a_worker_lost_in_a_run_is_not_kept_and_the_next_run_starts_one_in_its_place(fresh_workers, tmp_path):
    with elastic_dp.keep_workers():
        first = fit(TINY_GPT_TASK, tmp_path / "first", workers=2, min_workers=1, steps=6,
                    inject=["kill:step=2:rank=1"])  # its replacement is kept, joined or not
        second = fit(TINY_GPT_TASK, tmp_path / "second", workers=2, steps=6)
    started = next(e for e in first.events if e["kind"] == "mesh")["pids"]  # generation 0: rank 1 was killed
    assert len(set(_pids(second))) == 2 and started[0] in _pids(second) and started[1] not in _pids(second)
    fresh = fit(TINY_GPT_TASK, tmp_path / "fresh", workers=2, steps=6)
    for name, tensor in fresh.weights().items():
        assert torch.equal(second.weights()[name], tensor), name
