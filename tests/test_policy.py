"""The membership policy, driven one decision at a time with plain ids (no Ray, no torch)."""

from __future__ import annotations

import random
import time

import pytest

from elastic_dp import ConfigError
from elastic_dp.control.membership.policy import Action, ElasticPolicy
from elastic_dp.modes.sync.sharded import ChunkPlan, chunk_sources


def test_failure_reforms_over_survivors_then_joiners_in_rank_order():
    policy = ElasticPolicy(min_workers=2, max_workers=4)
    d = policy.after_failure(["a", "c"], ["x", "y", "z"], waited_s=0, has_checkpoint=False)
    assert d.action is Action.REFORM and d.members == ("a", "c", "x", "y")


def test_below_min_waits_then_fails_naming_the_setting():
    policy = ElasticPolicy(min_workers=3, max_workers=4, wait_timeout_s=10)
    assert policy.after_failure(["a", "b"], [], waited_s=3, has_checkpoint=True).action is Action.WAIT
    d = policy.after_failure(["a", "b"], [], waited_s=10, has_checkpoint=True)
    assert d.action is Action.FAIL and "--workers MIN:MAX" in d.reason and "--min-wait-timeout" in d.reason


def test_no_survivor_restores_from_checkpoint_or_fails_without_one():
    policy = ElasticPolicy(min_workers=1, max_workers=2)
    d = policy.after_failure([], ["n1", "n2", "n3"], waited_s=0, has_checkpoint=True)
    assert d.action is Action.RESTORE and d.members == ("n1", "n2")
    d = policy.after_failure([], ["n1"], waited_s=0, has_checkpoint=False)
    assert d.action is Action.FAIL and "--checkpoint-dir" in d.reason


def test_joiners_admitted_at_step_boundary_up_to_max():
    policy = ElasticPolicy(min_workers=1, max_workers=3)
    assert policy.at_step_boundary(["a", "b"], []).action is Action.CONTINUE
    d = policy.at_step_boundary(["a", "b"], ["x", "y"])
    assert d.action is Action.REFORM and d.members == ("a", "b", "x")
    assert policy.at_step_boundary(["a", "b", "c"], ["x"]).action is Action.CONTINUE
    assert policy.wanted(current=2, pending=0) == 1 and policy.wanted(current=3, pending=1) == 0


@pytest.mark.parametrize("bad", [(0, 2), (3, 2)])
def test_bad_range_is_refused(bad):
    with pytest.raises(ConfigError, match=r"ClusterConfig\(min_workers=MIN, workers=MAX\) needs 1 <= MIN <= MAX"):
        ElasticPolicy(min_workers=bad[0], max_workers=bad[1])


def test_simulation_of_ten_thousand_members_with_random_failures_and_joins():
    rng = random.Random(0)
    policy = ElasticPolicy(min_workers=5_000, max_workers=10_000, wait_timeout_s=5)
    members = list(range(10_000))
    next_id, joiners, waited, slowest = 10_000, [], 0.0, 0.0
    for _ in range(300):
        if rng.random() < 0.5:  # a burst of failures during a step
            dead = set(rng.sample(members, rng.randint(1, 2_000)))
            survivors = [m for m in members if m not in dead]
            start = time.perf_counter()
            d = policy.after_failure(survivors, joiners, waited_s=waited, has_checkpoint=True)
            slowest = max(slowest, time.perf_counter() - start)
            if d.action is Action.WAIT:
                waited += 1
                members = survivors
                continue
            if d.action is Action.FAIL:
                assert len(survivors) + len(joiners) < 5_000 and waited >= 5
                members, waited = survivors + joiners, 0.0  # capacity came back
                joiners = [next_id + i for i in range(5_000)]
                next_id += 5_000
                continue
            waited = 0.0
            assert d.action is Action.REFORM
            assert not dead & set(d.members)
            alive = set(survivors)
            kept = [m for m in d.members if m in alive]
            assert kept == survivors[:len(kept)]
        else:  # capacity arrives
            arriving = rng.randint(1, 3_000)
            joiners = joiners + [next_id + i for i in range(arriving)]
            next_id += arriving
            start = time.perf_counter()
            d = policy.at_step_boundary(members, joiners)
            slowest = max(slowest, time.perf_counter() - start)
        if d.action is Action.REFORM:
            assert 5_000 <= len(d.members) <= 10_000 and len(set(d.members)) == len(d.members)
            admitted = set(d.members) - set(members)
            joiners = [j for j in joiners if j not in admitted]
            members = list(d.members)
    assert slowest < 0.05, f"a decision took {slowest * 1e3:.1f} ms"


def _held(live, own=(), peer=()):
    return {"live": live, "own": list(own), "peer": list(peer)}


def test_chunk_sources_prefers_live_chunks_at_the_newest_common_step():
    # k=1, rank 1 of 3 died during step 7 (forward): everyone's live chunk is at 7
    plan = chunk_sources(3, {0: _held(7, (6, 7), (6, 7)), 2: _held(7, (6, 7), (6, 7))})
    assert plan == ChunkPlan(7, ((0, "live"), (2, "peer"), (2, "live")))


def test_chunk_sources_rolls_back_when_a_survivor_already_committed():
    # rank 2 committed step 7 (live 8) before the failure; rank 1's chunk exists only at 7
    plan = chunk_sources(3, {0: _held(7, (6, 7), (6, 7)), 2: _held(8, (6, 7), (6, 7))})
    assert plan == ChunkPlan(7, ((0, "live"), (2, "peer"), (2, "own")))


def test_chunk_sources_uses_an_older_snapshot_with_k_greater_than_1():
    plan = chunk_sources(4, {0: _held(25, (10, 20), (10, 20)), 1: _held(25, (10, 20), (10, 20)),
                             3: _held(25, (10, 20), (10, 20))})
    assert plan == ChunkPlan(20, ((0, "own"), (1, "own"), (3, "peer"), (3, "own")))


def test_chunk_sources_reports_a_chunk_lost_with_its_replica():
    # ranks 1 and 2 of 4 lost at once: rank 1's only replica was on rank 2
    assert chunk_sources(4, {0: _held(5, (4, 5), (4, 5)), 3: _held(5, (4, 5), (4, 5))}) is None
    assert chunk_sources(1, {}) is None


def test_chunk_sources_after_a_kill_during_a_snapshot():
    # rank 0 of 2 died while sending the step-8 snapshot: rank 1 holds rank 0's chunk at 7 only
    plan = chunk_sources(2, {1: _held(8, (7, 8), (7,))})
    assert plan == ChunkPlan(7, ((1, "peer"), (1, "own")))


def _replica(chunk, live, own=()):
    return {"chunk": chunk, "chunks": 2, "live": live, "own": list(own), "peer": []}


def test_chunk_sources_under_hsdp_takes_each_chunk_from_any_live_replica():
    # 2 hosts of 2 (chunks 0, 1 on ranks 0, 1 and again on 2, 3): host A (ranks 0, 1) lost
    plan = chunk_sources(4, {2: _replica(0, 9, (9,)), 3: _replica(1, 9, (9,))})
    assert plan == ChunkPlan(9, ((2, "live"), (3, "live")))
    # one worker of each host lost: chunk 0 from host B, chunk 1 from host A
    plan = chunk_sources(4, {1: _replica(1, 9, (9,)), 2: _replica(0, 9, (9,))})
    assert plan == ChunkPlan(9, ((2, "live"), (1, "live")))
    # a torn step: rank 2 committed step 9 (live 10), rank 3 did not; chunk 1 exists only at 9
    plan = chunk_sources(4, {2: _replica(0, 10, (9, 10)), 3: _replica(1, 9, (8, 9))})
    assert plan == ChunkPlan(9, ((2, "own"), (3, "live")))


def test_chunk_sources_under_hsdp_reports_a_chunk_lost_with_every_replica():
    # ranks 1 and 3 held chunk 1, and no peer snapshot is kept under HSDP
    assert chunk_sources(4, {0: _replica(0, 9, (9,)), 2: _replica(0, 9, (9,))}) is None


def test_the_snapshot_ring_alternates_between_nodes_so_each_peer_snapshot_is_on_another_node():
    from elastic_dp.comm.mesh import Mesh

    assert Mesh(("A", "A", "B", "B")).ring == (0, 2, 1, 3)  # ranks contiguous by host; the ring alternates
    assert Mesh(("A", "A")).ring == (0, 1)  # one node: the rank order
    assert Mesh(("A", "A", "B", "C")).ring == (0, 2, 1, 3)
    rng = random.Random(1)
    for _ in range(500):
        n = rng.randint(2, 16)
        nodes = tuple(sorted(rng.randint(0, 3) for _ in range(n)))  # a rank order: each node's ranks contiguous
        mesh = Mesh(tuple(map(str, nodes)))
        assert sorted(mesh.ring) == list(range(n))
        if max(nodes.count(k) for k in set(nodes)) <= n // 2:  # then every snapshot can be elsewhere
            assert all(nodes[r] != nodes[mesh.right(r)] for r in range(n)), (nodes, mesh.ring)


def test_chunk_sources_finds_a_peer_snapshot_at_the_rings_right_neighbour():
    # ranks 0, 1 on node A and 2, 3 on node B; the ring 0 2 1 3: rank 0's snapshot is kept by rank 2.
    # Node A lost: ranks 0 and 1's chunks come from their keepers on node B (2 and 3)
    from elastic_dp.comm.mesh import Mesh

    right = Mesh(("A", "A", "B", "B")).right
    plan = chunk_sources(4, {2: _held(7, (6, 7), (6, 7)), 3: _held(7, (6, 7), (6, 7))}, right)
    assert plan == ChunkPlan(7, ((2, "peer"), (3, "peer"), (2, "live"), (3, "live")))
    assert chunk_sources(4, {2: _held(7, (6, 7), (6, 7)), 3: _held(7, (6, 7), (6, 7))}) is None  # next-rank keepers
