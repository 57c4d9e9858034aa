"""``--compress powersgd`` through kills on a Ray cluster: a worker killed before its step's
vote and one killed after it (that step committed), a spare promoted in the first one's
place; the run ends on the replay of the contract (tests.reference.PowerSGDContract), which
knows nothing of the membership: the lost workers' errors are taken over from their copies
(docs/compression.md)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.reference import max_abs_diff, replay
from tests.runs import fit
from tests.tasks import TINY_GPT_TASK

pytestmark = pytest.mark.ray

TOL = 2e-5  # as tests/test_compression.py's GPT_TOL: 12 AdamW steps, float order
COMPRESSED_APART = 1e-2


def test_kills_before_and_after_the_vote_end_on_the_replay_of_the_contract(ray_cluster, tmp_path):
    run = fit(TINY_GPT_TASK, tmp_path, workers=3, min_workers=2, cluster={"spares": 1}, steps=12,
              inject=["kill:step=4:rank=1", "kill:step=8:rank=2:phase=optimizer"], compress="powersgd:rank=2:start=2")
    initial = str(tmp_path / "initial.safetensors")
    expected = replay(TINY_GPT_TASK, run.config, initial)
    assert max_abs_diff(run.weights(), expected) < TOL  # measured 2.9e-6 (one run, 2026-12-06): 7x margin
    uncompressed = replay(TINY_GPT_TASK, dataclasses.replace(run.config, compress=None), initial)
    assert max_abs_diff(run.weights(), uncompressed) > COMPRESSED_APART
    lost = [c for c in run.changes() if c["lost"]]
    assert [c["lost_ranks"] for c in lost] == [[1], [2]]
    # the first killed before its step's vote: step 4 re-run; the second after it: step 8
    # committed, and the loss is found in step 9 (a window goes on), the one re-run if it was begun
    assert (lost[0]["step"], lost[0]["steps_rerun"]) == (4, 1)
    assert lost[1]["step"] == 9 and lost[1]["steps_rerun"] in (0, 1)  # 0: the window was ending at 9 anyway
    assert lost[0]["promoted"] == 1


def test_an_error_lost_with_its_copy_restarts_from_the_checkpoint(ray_cluster, tmp_path):
    """Ranks 1 and 2 of 3 killed in one step: rank 1's error was copied to rank 2 (one host:
    each rank's to the next), so no survivor holds it. The re-formation finds that before
    any step (the survivors' ``reduction_holdings``), says so, and restarts from the latest
    checkpoint, whose rows hold every rank's error: the run ends on the contract's replay.
    Taking over only the copy that survived would leave it off by rank 1's error."""
    from elastic_dp import CheckpointConfig

    # written before the next step begins (--sync-checkpoints): a part still uploading when the
    # kill came abandoned step 4's checkpoint once, on a loaded machine, and left none to restore
    run = fit(TINY_GPT_TASK, tmp_path / "out", workers=3, min_workers=1, steps=10,
              checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every=4, asynchronous=False),
              inject=["kill:step=6:rank=1", "kill:step=6:rank=2"], compress="powersgd:rank=2:start=2")
    expected = replay(TINY_GPT_TASK, run.config, str(tmp_path / "out" / "initial.safetensors"))
    assert max_abs_diff(run.weights(), expected) < TOL
    restored, = [e for e in run.events if e["kind"] == "restored_from_checkpoint"]
    assert restored["step"] == 4 and "--compress error feedback of 1 lost worker(s)" in restored["decision"]


def test_int8_through_a_kill_and_a_join_ends_on_the_replay_that_simulates_its_members(ray_cluster, tmp_path):
    """``--compress int8`` on up to 3 workers (2 at the start: the join holds one back): rank 1
    killed in step 3 (its error taken over by the rank that held its copy), workers joining;
    the replay simulates each member's
    quantization and error through the same membership (tests.reference.replay_members), on
    one thread of torch's as the workers (the integers turn a float-order difference at a
    rounding edge into a whole step)."""
    from tests.reference import replay_members
    from tests.test_diloco_ray import one_thread

    run = fit(TINY_GPT_TASK, tmp_path, workers=3, min_workers=2, steps=10, micro_batch=None, compress="int8",
              inject=["kill:step=3:rank=1", "join:step=6"])
    membership = [(c["step"], c.get("lost_ranks", []), c["joined"]) for c in run.changes()]
    # a replacement may join in the kill's own re-formation (a kept worker is ready at once),
    # taking rank 1's index, or later: the replay follows what happened
    assert membership[0][:2] == (3, [1]) and sum(j for _, _, j in membership) >= 1, membership
    initial = str(tmp_path / "initial.safetensors")
    world = next(e for e in run.events if e["kind"] == "group_formed")["world_size"]  # 2: the join holds one back
    expected = one_thread(replay_members)(TINY_GPT_TASK, run.config, initial, world=world, changes=membership)
    assert max_abs_diff(run.weights(), expected) < TOL  # measured 0 (one run, 2026-12-06)
    # without the lost worker's error taken over, the replay ends elsewhere
    dropped = one_thread(replay_members)(TINY_GPT_TASK, run.config, initial, world=world, changes=membership,
                                         take_over=False)
    assert max_abs_diff(expected, dropped) > 10 * TOL


def test_powersgd_at_zero_2_through_kills_and_a_join_ends_on_the_replay_of_the_contract(ray_cluster, tmp_path):
    """ZeRO-2 with ``--compress powersgd``: each bucket's approximation is the whole bucket's
    on every rank and each rank keeps its chunk of it, so the contract is stage 0's, at any
    membership. Rank 1 killed before step 4's vote (step 4 re-run from the peer snapshots and
    the errors as they were before it), rank 2 killed in step 8's optimizer, after the vote:
    its chunk's newest copy is its peer snapshot of step 8, so every survivor's error goes
    back one step to it (``ErrorFeedback.rewind``) and step 8 is re-run; a worker joins in
    between. The run ends on the replay of the contract (which equals an uninterrupted run at
    any N, tests/test_compression.py), far from the uncompressed one."""
    run = fit(TINY_GPT_TASK, tmp_path, workers=3, min_workers=2, steps=12, zero=2,
              inject=["kill:step=4:rank=1", "join:step=6", "kill:step=8:rank=2:phase=optimizer"],
              compress="powersgd:rank=2:start=2")
    initial = str(tmp_path / "initial.safetensors")
    expected = replay(TINY_GPT_TASK, run.config, initial)
    assert max_abs_diff(run.weights(), expected) < TOL
    uncompressed = replay(TINY_GPT_TASK, dataclasses.replace(run.config, compress=None), initial)
    assert max_abs_diff(run.weights(), uncompressed) > COMPRESSED_APART
    lost = [c for c in run.changes() if c["lost"]]
    assert [c["lost_ranks"] for c in lost] == [[1], [2]], run.changes()
    assert any(c["joined"] for c in run.changes())
    assert lost[1]["restored_step"] == 8 and lost[1]["steps_rerun"] >= 1, lost[1]  # rewound past a committed step

