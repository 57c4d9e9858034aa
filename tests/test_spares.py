"""Warm spares (``--spares K``) on a Ray cluster: a worker killed in a step is replaced by
a spare in the same re-formation, so the group never trains one short, and the run ends
where the one-process replay of the same batches ends, at stage 0, ZeRO-2 and ZeRO-3. At
stage 0 a spare kept in step (``--spare-copy-every``) is sent nothing at a promotion at its
copy's step, and its copy is the state that survives when every member is lost at once.
The membership decisions (a spare lost while it stands by, one lost with a member, none
ready, a leave notice) are tested with fakes in tests/test_coordinator.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from elastic_dp.modes.sync.layouts import ReplicatedLayout
from elastic_dp.state.zero.settings import Stage0
from tests.reference import max_abs_diff, replay
from tests.runs import fit
from tests.tasks import TINY_GPT_TASK

TOL = 2e-5  # as tests/test_elastic.py: the tiny GPT, 6 steps, float32 reduction order
# worst measured 2.6e-06 (3 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 8x margin


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_a_spare_takes_a_killed_members_place_and_the_group_never_shrinks(ray_cluster, tmp_path, zero):
    # at stage 0 the spare is kept in step every 3 steps (--spare-copy-every): a copy at the
    # start of the window from step 3, so the kill in step 3 finds it holding the state after
    # 3 steps, which is what the survivor holds, and it is sent nothing
    copies = {"spare_copy_every": 3} if zero == 0 else {}
    run = fit(TINY_GPT_TASK, tmp_path, workers=2, cluster={"spares": 1}, inject=["kill:step=3:rank=1"], steps=6,
              zero=zero, **copies)
    expected = replay(TINY_GPT_TASK, run.config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(run.weights(), expected) < TOL
    change, = run.changes()
    assert (change["lost_ranks"], change["joined"], change["promoted"], change["world_size"]) == ([1], 1, 1, 2)
    assert change["steps_rerun"] == 1  # the interrupted step, and no other
    metrics = run.lines("metrics")
    assert [m["step"] for m in metrics] == list(range(6))
    assert {m["world_size"] for m in metrics} == {2}  # no step trained one short
    if zero == 0:
        assert change["state_sent"] == 0


def test_a_promoted_spare_takes_the_lost_ranks_index_and_only_the_lost_chunk_moves(ray_cluster, tmp_path):
    # ZeRO-2 over 3 ranks: rank 1 killed, the spare becomes rank 1; ranks 0 and 2 keep their
    # places, their chunks and their left neighbours' snapshots, and fetch nothing; the
    # spare fetches its chunk (rank 2's snapshot of it) and its left neighbour's (rank 0's)
    run = fit(TINY_GPT_TASK, tmp_path, workers=3, cluster={"spares": 1}, inject=["kill:step=3:rank=1"], steps=6,
              zero=2)
    expected = replay(TINY_GPT_TASK, run.config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(run.weights(), expected) < TOL
    before, after = [e["pids"] for e in run.events if e["kind"] == "mesh"]
    assert after[0] == before[0] and after[2] == before[2] and after[1] not in before
    change, = run.changes()
    assert (change["lost_ranks"], change["promoted"], change["world_size"]) == ([1], 1, 3)
    assert change["chunks_fetched"] == 2


def test_every_member_lost_at_once_goes_back_to_the_spares_copy_and_ends_on_the_replay(ray_cluster, tmp_path):
    # copies at steps 0, 2 and 4; both members killed in step 5: the spare's copy (the state
    # after 4 steps) is all that survived, so the run goes back to it and re-runs steps 4 and 5
    run = fit(TINY_GPT_TASK, tmp_path, workers=2, min_workers=1, cluster={"spares": 1}, steps=8,
              inject=["kill:step=5:rank=0", "kill:step=5:rank=1"], spare_copy_every=2)
    expected = replay(TINY_GPT_TASK, run.config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(run.weights(), expected) < TOL  # measured 1.2e-6 (8 steps, one run): 17x margin
    change = run.changes()[0]
    assert (change["lost"], change["promoted"], change["state_from"], change["restored_step"]) == (2, 1, "spare", 4)
    assert change["steps_rerun"] == 2
    # metrics.jsonl keeps both lines of a step trained again; the summary counts each step once
    assert [m["step"] for m in run.lines("metrics")] == [0, 1, 2, 3, 4, 4, 5, 6, 7]
    assert run.summary.steps == 8


class _Member:
    def __init__(self, actor) -> None:
        self.actor = actor


class _Gens:
    """What ``ReplicatedLayout``'s copies use of ``Generations``: the members, and calls
    gathered (here without a deadline)."""

    def __init__(self, members: list) -> None:
        import ray

        self._get = ray.get
        self.members, self.generation = members, 0
        self.calls = SimpleNamespace(gather=self._gather)

    def _gather(self, refs: dict, generation: int, what: str = "") -> SimpleNamespace:
        return SimpleNamespace(results={m: self._get(ref) for ref, m in refs.items()})

    def run(self, group: list, refs: dict) -> dict:
        return self._gather(refs, self.generation).results


def test_a_spare_still_loading_a_copy_loads_the_newest_one_put_since_when_it_ends(ray_cluster):
    # a spare whose loads take 1.5 s, copies put at steps 0, 2 and 4 within a few ms: the
    # spare loads 0, then 4 (2 was replaced before it started), never two at once, and the
    # coordinator asking for the copies (every member lost) waits for the one in flight
    import ray

    @ray.remote(max_concurrency=3)  # threaded, as WorkerActor is
    class Worker:
        def __init__(self) -> None:
            self.loads, self.loading = [], 0

        @ray.method(num_returns=2)
        def share_state(self, step: int, sampler: dict) -> tuple:
            return step, {"step": step}

        def load_state(self, state: dict) -> None:
            self.loading += 1
            overlapped = self.loading > 1
            time.sleep(1.5)
            self.loading -= 1
            self.loads.append((state["step"], overlapped))

        def seen(self) -> list:
            return self.loads

    member, spare = (_Member(Worker.remote()) for _ in range(2))
    layout = ReplicatedLayout(_Gens([member]), dict, Stage0(spare_copy_every=2))
    windows = [layout.before_window(step, 100, [spare]) for step in (0, 2, 4)]
    assert windows == [2, 4, 6]
    started = time.monotonic()
    assert layout.copies() == {spare: 4}
    assert time.monotonic() - started > 2.0  # it waited for both loads, one after the other
    assert ray.get(spare.actor.seen.remote()) == [(0, False), (4, False)]
    for worker in (member, spare):
        ray.kill(worker.actor)
