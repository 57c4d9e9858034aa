"""The coordinator's state machine, driven with a fake training mode and a fake worker
pool (no Ray, no tensors): each test asserts the sequence of states and the reasons of
the decisions taken on the way."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_dp import CheckpointConfig, MembershipError, TrainConfig
from elastic_dp.control.coordinator import Coordinator, RunState
from elastic_dp.control.membership import Membership
from elastic_dp.control.membership.policy import POLICIES, ElasticPolicy
from elastic_dp.errors import ConfigError
from elastic_dp.faults import Fault, FaultPlan
from elastic_dp.modes.base import MembersLost, Recovery, RecoveryResult, SaveOutcome, classify
from elastic_dp.observe.metrics import RunRecorder
from tests.fakes import FakeClock, FakePool


class FakeMode:
    """Trains nothing. ``losses[step]``: ranks lost in that step (once); ``reform_losses``:
    ranks lost in successive re-formations; ``state_lost``: re-formations that find no copy
    of the state (as ZeRO does when a chunk and its snapshot are gone)."""

    def __init__(self, losses=None, reform_losses=(), state_lost=0, resize_losses=(), eval_losses=None,
                 at=None) -> None:
        self.losses, self.reform_losses, self.state_lost = dict(losses or {}), list(reform_losses), state_lost
        self.at = dict(at or {})  # step -> a callable run (once) as the step starts: the world outside acts
        self.resize_losses = list(resize_losses)
        self.eval_losses = dict(eval_losses or {})  # step -> ranks lost while evaluating after it (once)
        self.generation, self.members, self.calls, self.ended = -1, [], [], []

    def _form(self, members) -> None:
        self.generation += 1
        self.members = list(members)

    def start(self, members, resume) -> int:
        self._form(members)
        return resume.step if resume else 0

    def advance(self, step: int, limit: int | None = None, keep_going=lambda: True, wake=list) -> int:
        """A window: steps until ``limit``, or until ``keep_going`` says no between two."""
        limit = step + 1 if limit is None else limit
        while True:
            if step in self.at:
                self.at.pop(step)()
            if step in self.losses:
                lost = [self.members[r] for r in self.losses.pop(step)]
                raise MembersLost(self.members, lost, f"{lost} died", step=step)
            step += 1
            if step >= limit or not keep_going():
                return step

    def resize(self, members) -> None:
        self.calls.append(("resize", len(members)))
        if self.resize_losses:
            lost = [members[r] for r in self.resize_losses.pop(0)]
            raise MembersLost(members, lost, f"{lost} died while joining")
        self._form(members)

    def reform(self, members, failure) -> RecoveryResult:
        self.calls.append(("reform", len(members)))
        if self.reform_losses:
            lost = [members[r] for r in self.reform_losses.pop(0)]
            self.generation += 1
            raise MembersLost(members, lost, f"{lost} died while forming")
        if self.state_lost:
            self.state_lost -= 1
            return RecoveryResult(Recovery.STATE_LOST, reason="a chunk and its snapshot were lost")
        self._form(members)
        return RecoveryResult(classify(failure, failure.step), failure.step)

    def restore(self, members, state) -> None:
        self.calls.append(("restore", state.step))
        self._form(members)

    def evaluate(self, step: int) -> tuple[float, int]:
        self.calls.append(("evaluate", step))
        if step in self.eval_losses:
            lost = [self.members[r] for r in self.eval_losses.pop(step)]
            raise MembersLost(self.members, lost, f"{lost} died while evaluating")
        return 1.0 / step, 10

    def save(self, store, step: int) -> None:
        store.saved.append(step)
        self.ended.append(SaveOutcome(step, f"step-{step}", 0.0, 0.0, 0))

    def settle_saves(self, wait: bool = False) -> list:
        ended, self.ended = self.ended, []
        return ended

    def finish(self) -> None:
        self.calls.append(("finish", len(self.members)))

    def close(self) -> None:
        pass  # no actors of its own

    def standby(self, workers) -> None:
        self.calls.append(("standby", [w.id for w in workers]))

    def state_copies(self) -> dict:
        return {}


@dataclasses.dataclass
class FakeState:
    step: int
    sampler: dict = dataclasses.field(default_factory=lambda: {"global_batch": 32, "seed": 0})
    manifest: dict = dataclasses.field(default_factory=dict)
    url: str = "fake"


class FakeStore:
    def __init__(self, saved=()) -> None:
        self.saved = list(saved)

    def check_writable(self) -> None:
        pass

    url = "fake-store"

    def latest(self):
        return FakeState(self.saved[-1]) if self.saved else None

    def load(self) -> FakeState:
        return FakeState(self.saved[-1])


def _run(mode, *, workers=3, min_workers=2, capacity=None, steps=6, faults=(), store=None, every=0,
         wait_timeout_s=300.0, eval_every=None, policy="elastic", spares=0, pool=None):
    clock = FakeClock()
    pool = pool or FakePool(capacity if capacity is not None else workers + spares)
    joins = sum(f.kind == "join" for f in faults)
    membership = Membership(pool, min_workers=min_workers, max_workers=workers, spares=spares, held_back=joins,
                            wait_timeout_s=wait_timeout_s, clock=clock, policy=policy)
    coordinator = Coordinator(mode, membership, train=TrainConfig(steps=steps, eval_every=eval_every),
                              faults=FaultPlan(faults),
                              recorder=RunRecorder(None, total_steps=steps, progress=False), store=store,
                              checkpoint=CheckpointConfig(dir="unused", every=every), sleep=clock.sleep)
    return coordinator, pool, clock


def _states(coordinator) -> list[str]:
    return [t.state.name for t in coordinator.history]


def _reason(coordinator, state: RunState) -> str:
    return next(t.reason for t in coordinator.history if t.state is state)


def test_a_kill_reforms_over_the_survivors_and_the_replacement_joins_at_the_next_boundary():
    mode = FakeMode(losses={2: [1]})
    coordinator, pool, _ = _run(mode)
    summary = coordinator.run()
    assert _states(coordinator) == ["STARTING", "RUNNING", "RECOVERING", "REFORMING", "RUNNING", "RESIZING",
                                    "RUNNING", "FINISHING", "FINISHED"]
    assert _reason(coordinator, RunState.RECOVERING) == "[w1] died"
    assert _reason(coordinator, RunState.REFORMING) == "2 survivor(s), 0 joiner(s)"
    assert "rerun: step 2 is next" in [t.reason for t in coordinator.history]
    assert _reason(coordinator, RunState.RESIZING) == "1 worker(s) joining"  # the replacement, requested
    assert pool.stopped[0].id == 1 and mode.calls[:2] == [("reform", 2), ("resize", 3)]
    change = next(e for e in summary.events if e["kind"] == "membership_changed")
    assert change["lost_ranks"] == [1] and change["steps_rerun"] == 1 and change["attempts"] == 1


def test_every_worker_lost_restores_from_the_checkpoint():
    store = FakeStore(saved=[2])
    mode = FakeMode(losses={3: [0, 1]})
    coordinator, _, _ = _run(mode, workers=2, min_workers=1, store=store, every=2)
    summary = coordinator.run()
    # nobody survived: wait (one poll) for the replacements, then restart them from step 2
    assert _states(coordinator) == ["STARTING", "RUNNING", "SAVING", "RUNNING", "RECOVERING", "WAITING",
                                    "RECOVERING", "RESTORING", "RUNNING", "SAVING", "RUNNING", "SAVING", "FINISHING",
                                    "FINISHED"]
    assert _reason(coordinator, RunState.WAITING).startswith("0 of the 1 workers needed are available")
    assert _reason(coordinator, RunState.RESTORING) == "no worker survived; restarting from the latest checkpoint"
    assert ("restore", 2) in mode.calls
    restored = next(e for e in summary.events if e["kind"] == "restored_from_checkpoint")
    assert restored["step"] == 2 and restored["steps_rerun"] == 2
    assert store.saved == [2, 2, 4, 6]  # the save at step 2 is taken again after the restore


def test_a_lost_shard_and_its_snapshot_restore_from_the_checkpoint():
    store = FakeStore(saved=[2])
    mode = FakeMode(losses={3: [1, 2]}, state_lost=1)
    coordinator, _, _ = _run(mode, workers=3, min_workers=1, store=store)
    coordinator.run()
    states = _states(coordinator)
    assert states[:6] == ["STARTING", "RUNNING", "RECOVERING", "REFORMING", "RESTORING", "RUNNING"]
    assert _reason(coordinator, RunState.RESTORING) == "a chunk and its snapshot were lost"


def test_the_same_without_a_checkpoint_fails_naming_the_settings():
    mode = FakeMode(losses={3: [1, 2]}, state_lost=1)
    coordinator, _, _ = _run(mode, workers=3, min_workers=1)
    with pytest.raises(MembershipError, match="snapshot were lost, and there is no durable checkpoint: "
                                              r"pass CheckpointConfig\.dir and CheckpointConfig\.every"):
        coordinator.run()
    assert _states(coordinator)[-3:] == ["RECOVERING", "REFORMING", "FAILED"]


def test_below_min_waits_for_capacity_then_fails():
    mode = FakeMode(losses={2: [1]})
    coordinator, pool, clock = _run(mode, workers=2, min_workers=2, wait_timeout_s=3.0)
    pool.slots_go_with_workers = True  # no replacement is ever placed
    with pytest.raises(MembershipError, match=r"only 1 workers available after waiting 3 s.*ClusterConfig\.min_wait_timeout_s"):
        coordinator.run()
    states = _states(coordinator)
    assert states[:3] == ["STARTING", "RUNNING", "RECOVERING"] and states[-1] == "FAILED"
    assert set(states[2:-1]) == {"RECOVERING", "WAITING"} and states.count("WAITING") == 15  # 3 s / 0.2 s
    assert "1 of the 2 workers needed are available" in _reason(coordinator, RunState.WAITING)
    assert clock.now == pytest.approx(3.0)


def test_a_join_is_admitted_at_its_step_boundary():
    mode = FakeMode()
    coordinator, pool, _ = _run(mode, workers=3, min_workers=2, faults=[Fault("join", 3)])
    summary = coordinator.run()
    assert _states(coordinator) == ["STARTING", "RUNNING", "RESIZING", "RUNNING", "FINISHING", "FINISHED"]
    assert _reason(coordinator, RunState.RESIZING) == "1 worker(s) joining"
    assert pool.requested == [2, 3, 0]  # the autoscaler is asked for the target as it grows; withdrawn at the end
    assert mode.calls == [("resize", 3), ("finish", 3)]
    change = next(e for e in summary.events if e["kind"] == "membership_changed")
    assert change["joined"] == 1 and change["world_size"] == 3


def test_a_failure_while_reforming_is_one_more_failure_of_the_same_recovery():
    mode = FakeMode(losses={2: [1]}, reform_losses=[[0]])
    coordinator, pool, _ = _run(mode, workers=3, min_workers=1, capacity=3)
    summary = coordinator.run()
    assert _states(coordinator) == ["STARTING", "RUNNING", "RECOVERING", "REFORMING", "RECOVERING", "REFORMING",
                                    "RUNNING", "RESIZING", "RUNNING", "FINISHING", "FINISHED"]
    reasons = [t.reason for t in coordinator.history]
    assert reasons[2] == "[w1] died" and reasons[4] == "[w0] died while forming"
    assert [m.id for m in pool.stopped[:2]] == [1, 0]
    interrupted = next(e for e in summary.events if e["kind"] == "reform_interrupted")
    assert interrupted["lost_ranks"] == [0] and interrupted["during"] == "reforming"
    change = next(e for e in summary.events if e["kind"] == "membership_changed")
    assert change["attempts"] == 2 and change["lost"] == 2 and change["lost_ranks"] == [1]
    assert change["steps_rerun"] == 1 and coordinator.step == 6


def test_a_worker_lost_while_joiners_are_admitted_loses_no_step():
    mode = FakeMode(resize_losses=[[2]])  # the joiner dies as the group grows at step 3
    coordinator, _, _ = _run(mode, workers=3, min_workers=2, faults=[Fault("join", 3)])
    summary = coordinator.run()
    # ... and its replacement joins at the next boundary
    assert _states(coordinator) == ["STARTING", "RUNNING", "RESIZING", "RECOVERING", "REFORMING", "RUNNING",
                                    "RESIZING", "RUNNING", "FINISHING", "FINISHED"]
    assert _reason(coordinator, RunState.RECOVERING) == "[w2] died while joining"
    assert "committed: step 3 is next" in [t.reason for t in coordinator.history]
    reformed, joined = [e for e in summary.events if e["kind"] == "membership_changed"]
    assert reformed["steps_rerun"] == 0 and reformed["world_size"] == 2 and reformed["lost_ranks"] == [2]
    assert joined["joined"] == 1 and joined["world_size"] == 3 and coordinator.step == 6


def test_a_loss_during_an_evaluation_re_runs_the_evaluation_never_a_step():
    """Evaluations after steps 4 and 8 and after the last (10); a worker dies in the one after
    step 8: the group re-forms with no step re-run, and that evaluation runs again."""
    mode = FakeMode(eval_losses={8: [2]})
    coordinator, _, _ = _run(mode, steps=10, eval_every=4)
    coordinator.run()
    assert [c for c in mode.calls if c[0] == "evaluate"] == [("evaluate", 4), ("evaluate", 8), ("evaluate", 8),
                                                              ("evaluate", 10)]
    states = _states(coordinator)
    assert states[states.index("EVALUATING", states.index("EVALUATING") + 1):][:5] == [
        "EVALUATING", "RECOVERING", "REFORMING", "RUNNING", "EVALUATING"]
    change = next(e for e in coordinator.recorder.summary.events if e["kind"] == "membership_changed")
    assert change["steps_rerun"] == 0 and change["step"] == 8
    assert coordinator.recorder.summary.eval_loss == pytest.approx(1 / 10)


class OneSpare(ElasticPolicy):
    """A policy registered beside the elastic one: it keeps one ready worker beyond MAX."""

    def wanted(self, current: int, pending: int) -> int:
        return max(0, self.max_workers + 1 - current - pending)


def test_a_registered_policy_that_keeps_a_worker_ready_has_the_mode_told_of_its_standby(monkeypatch):
    monkeypatch.setitem(POLICIES, "one-spare", OneSpare)
    mode = FakeMode(losses={3: [1]})
    coordinator, pool, _ = _run(mode, workers=2, min_workers=2, capacity=3, steps=6, policy="one-spare")
    coordinator.run()
    told = [c[1] for c in mode.calls if c[0] == "standby"]
    assert told == [[2], [3]]  # the third worker beside the two members; after the kill, its replacement
    assert ("reform", 2) in mode.calls and "WAITING" not in _states(coordinator)  # w2 took w1's place at once
    with pytest.raises(ConfigError, match="membership policy must be one of elastic, one-spare, got 'x'"):
        Membership(pool, min_workers=1, max_workers=2, policy="x")


# -- warm spares (--spares K) ------------------------------------------------------------------
def _changes(coordinator) -> list[dict]:
    return [e for e in coordinator.recorder.summary.events if e["kind"] == "membership_changed"]


def test_a_spare_takes_a_lost_members_place_in_the_same_re_formation_and_another_is_started():
    mode = FakeMode(losses={2: [1]})
    coordinator, pool, _ = _run(mode, workers=3, min_workers=2, spares=1)
    coordinator.run()
    assert _states(coordinator) == ["STARTING", "RUNNING", "RECOVERING", "REFORMING", "RUNNING", "FINISHING",
                                    "FINISHED"]  # no RESIZING: nothing joins later
    assert _reason(coordinator, RunState.REFORMING) == "2 survivor(s), 1 joiner(s)"
    change, = _changes(coordinator)
    assert (change["world_size"], change["lost"], change["joined"], change["promoted"]) == (3, 1, 1, 1)
    assert ("reform", 3) in mode.calls and ("resize", 3) not in mode.calls
    assert [m.id for m in mode.members] == [0, 2, 3] and pool.stopped[0].id == 1  # w3, the spare, took w1's place
    assert len(pool.stopped) == 5  # ... and w4 was started as the next spare (all stopped at the end)
    assert [c[1] for c in mode.calls if c[0] == "standby"] == [[3], [4]]
    assert coordinator.membership.policy.wanted(3, 1) == 0  # the group and its one spare: nothing more to ask


def test_a_spare_that_dies_standing_by_is_replaced_and_the_group_never_notices():
    pool = FakePool(4)
    mode = FakeMode(at={3: lambda: pool.die(next(m for m in pool.alive if m.id == 3))})
    coordinator, _, _ = _run(mode, workers=3, spares=1, pool=pool)
    coordinator.run()
    assert "RECOVERING" not in _states(coordinator) and not _changes(coordinator)
    assert pool.stopped[0].id == 3 and [m.id for m in mode.members] == [0, 1, 2]
    assert len(pool.stopped) == 5  # w4 started in its place (the mode hears of it at the next window)


def test_a_spare_lost_with_a_member_is_not_admitted_and_the_run_goes_on_without_it():
    pool = FakePool(4)
    mode = FakeMode(at={2: lambda: pool.die(next(m for m in pool.alive if m.id == 3))}, losses={2: [0]})
    coordinator, _, _ = _run(mode, workers=3, min_workers=2, spares=1, pool=pool, steps=8)
    coordinator.run()
    first, second = _changes(coordinator)
    assert (first["world_size"], first["lost"], first["promoted"]) == (2, 1, 0)  # the dead spare left out
    assert (second["world_size"], second["joined"], second["promoted"]) == (3, 1, 0)  # a new worker, later


def test_without_a_spare_ready_a_loss_takes_the_old_path_shrink_then_join():
    pool = FakePool(3)  # no room for the spare; the loss takes its slot with it (a lost node)
    pool.slots_go_with_workers = True
    mode = FakeMode(losses={2: [1]}, at={4: lambda: setattr(pool, "capacity", pool.capacity + 1)})  # a node returns
    coordinator, _, _ = _run(mode, workers=3, min_workers=2, spares=1, pool=pool, steps=8)
    coordinator.run()
    first, second = _changes(coordinator)
    assert (first["world_size"], first["promoted"]) == (2, 0) and (second["world_size"], second["joined"]) == (3, 1)
    assert not [c for c in mode.calls if c[0] == "standby"]


def test_a_leave_notice_promotes_a_spare_at_the_next_boundary():
    from elastic_dp.messages import LeaveNotice

    pool = FakePool(4)
    mode = FakeMode(at={3: lambda: pool.notices.update({pool.alive[1]: LeaveNotice("drain", "drain of node n1")})})
    coordinator, _, _ = _run(mode, workers=3, min_workers=3, spares=1, pool=pool)
    coordinator.run()
    change, *_ = _changes(coordinator)
    assert (change["world_size"], change["left"], change["joined"], change["promoted"]) == (3, 1, 1, 1)
    assert change["steps_rerun"] == 0 and "RECOVERING" not in _states(coordinator)


class CopyingMode(FakeMode):
    """A mode that copies the state to its spares at every step (``--spare-copy-every 1``,
    stage 0), as ``ReplicatedLayout`` does: ``state_copies`` names the spares and their step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spares, self.copied = [], 0

    def standby(self, workers) -> None:
        super().standby(workers)
        self.spares = list(workers)

    def advance(self, step: int, limit: int | None = None, keep_going=lambda: True, wake=list) -> int:
        self.copied = step  # the copy at the start of the window (one step a window here)
        return super().advance(step, step + 1, keep_going, wake)

    def state_copies(self) -> dict:
        return {spare: self.copied for spare in self.spares}

    def reform(self, members, failure) -> RecoveryResult:
        self.calls.append(("reform", [m.id for m in members]))
        self._form(members)
        return RecoveryResult(classify(failure, self.copied), self.copied)


def test_where_every_member_is_lost_the_spares_copy_is_kept_as_a_survivor_and_the_run_goes_back_to_it():
    mode = CopyingMode(losses={4: [0, 1]})
    coordinator, _, _ = _run(mode, workers=2, min_workers=1, spares=1, steps=8)
    coordinator.run()
    assert ("reform", [2]) in mode.calls  # the spare alone (the two replacements are not built yet)
    assert _reason(coordinator, RunState.REFORMING) == "1 survivor(s), 0 joiner(s)"
    change = _changes(coordinator)[0]
    assert (change["lost"], change["promoted"], change["world_size"]) == (2, 1, 1)
    assert coordinator.step == 8 and ("finish", 2) in mode.calls  # the replacements joined later


def test_where_every_member_is_lost_a_newer_checkpoint_wins_over_a_spares_copy():
    mode = CopyingMode(losses={4: [0, 1]})
    mode.state_copies = lambda: {spare: 2 for spare in mode.spares}  # a copy older than the checkpoint
    coordinator, _, _ = _run(mode, workers=2, min_workers=1, spares=1, steps=8, store=FakeStore(), every=3)
    coordinator.run()
    assert ("restore", 3) in mode.calls and not [c for c in mode.calls if c[0] == "reform"]
