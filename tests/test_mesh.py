"""The generation's mesh (elastic_dp.comm.mesh) and its sub-groups (CollectiveGroup.subgroup):
the named dimensions against hand-listed groups, sums over each sub-group against closed
forms, a two-level sum (inside each host, then across) against the flat one, and a
sub-group that lives and dies with its generation (an abort of the generation releases a
rank blocked in it; the next generation builds its own)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elastic_dp.comm.mesh import Mesh, rank_order
from elastic_dp.errors import CollectiveError
from tests.ranks import run_ranks


def test_the_dimensions_of_an_uneven_mesh():
    mesh = Mesh(("A", "A", "B", "B", "B"))
    assert mesh.groups("world") == [(0, 1, 2, 3, 4)]
    assert mesh.groups("host") == [(0, 1), (2, 3, 4)]
    # three pieces (host B's ranks): on host A rank 0 owns pieces 0 and 1, rank 1 piece 2
    assert mesh.pieces == 3 and [mesh.owned(r) for r in range(5)] == [range(0, 2), range(2, 3), *map(range, (0, 1, 2), (1, 2, 3))]
    assert mesh.groups("across") == [(0, 2), (0, 3), (1, 4)]
    assert [mesh.local_rank(r) for r in range(5)] == [0, 1, 0, 1, 2]
    assert mesh.group("across", 3) == (0, 3) and mesh.indices("across", 0) == [0, 1]
    with pytest.raises(ValueError, match="dimensions world, host, across, shard, replica, not 'rack'"):
        mesh.groups("rack")


@pytest.mark.parametrize("hosts, shards, replicas", [
    ("AABB", [(0, 1), (2, 3)], [(0, 2), (1, 3)]),  # equal hosts: a block is a host
    ("AAAABB", [(0, 1), (2, 3), (4, 5)], [(0, 2, 4), (1, 3, 5)]),  # 4 and 2: blocks of 2, host A holds two copies
    ("AAB", [(0,), (1,), (2,)], [(0, 1, 2)]),  # 2 and 1: every rank a whole copy
    ("AAA", [(0, 1, 2)], [(0,), (1,), (2,)]),  # one host: one copy cut over every rank, as --shard-scope all
])
def test_hsdp_blocks_lie_inside_one_host_and_replicas_hold_one_chunk_on_each(hosts, shards, replicas):
    mesh = Mesh(tuple(hosts))
    assert mesh.groups("shard") == shards and mesh.groups("replica") == replicas
    assert mesh.shards("host") == len(shards[0]) and mesh.shards("all") == len(hosts)
    for block in shards:
        assert len({hosts[r] for r in block}) == 1
        assert [mesh.shard_of(r, "host") for r in block] == list(range(len(block)))
    for i, replica in enumerate(replicas):
        assert {mesh.shard_of(r, "host") for r in replica} == {i}
    assert [mesh.shard_of(r, "all") for r in range(len(hosts))] == list(range(len(hosts)))


def test_equal_hosts_pair_one_local_index_across():
    mesh = Mesh(("A", "A", "B", "B", "C", "C"))
    assert mesh.pieces == 2 and mesh.groups("across") == [(0, 2, 4), (1, 3, 5)]
    assert mesh.spans_hosts() and not Mesh(("A", "B")).spans_hosts() and not Mesh(("A", "A")).spans_hosts()


def test_the_rank_order_keeps_each_host_contiguous_and_a_joiner_beside_its_host():
    host = {"a0": "A", "a1": "A", "b0": "B", "b1": "B", "a2": "A"}
    # the policy lists survivors, then the joiner a2 (on host A): it sits beside A's ranks
    assert rank_order(["a0", "b0", "a1", "b1", "a2"], host.__getitem__) == ["a0", "a1", "a2", "b0", "b1"]
    assert rank_order(["b1", "a0", "b0"], host.__getitem__) == ["b1", "b0", "a0"]


def test_across_a_re_formation_a_joiner_takes_the_place_its_host_left_and_the_others_keep_theirs():
    host = {"a0": "A", "a1": "A", "a2": "A", "b0": "B", "b1": "B", "s": "A", "t": "B", "c0": "C"}.__getitem__
    was = ["a0", "a1", "b0", "b1"]
    # a1 lost, the spare s (host A) promoted: s is rank 1, every other rank keeps its own
    assert rank_order(["a0", "b0", "b1", "s"], host, was) == ["a0", "s", "b0", "b1"]
    # b0 lost, s on host A: B's ranks stay together, so b1 moves up and s goes beside A's
    assert rank_order(["a0", "a1", "b1", "s"], host, was) == ["a0", "a1", "s", "b1"]
    # the policy listing B first does not reorder the hosts that were there; a new host goes last
    assert rank_order(["b1", "c0", "b0", "a0", "a1"], host, was) == ["a0", "a1", "b0", "b1", "c0"]
    # two places left on A, one joiner: it takes the first, the survivors keep their order
    assert rank_order(["a2", "b0", "b1", "s"], host, ["a0", "a1", "a2", "b0", "b1"]) == ["s", "a2", "b0", "b1"]
    # more joiners than places: the rest after their host's ranks
    assert rank_order(["a0", "b0", "t", "s", "b1"], host, ["a0", "a1", "b0"]) == ["a0", "s", "b0", "t", "b1"]
    # without the last order: the policy's, by host
    assert rank_order(["a0", "b0", "b1", "s"], host) == ["a0", "s", "b0", "b1"]


@pytest.mark.parametrize("hosts", [("A", "A", "B", "B"), ("A", "A", "A", "B", "B"), ("A", "A", "B"),
                                   ("A", "B", "C", "C"), ("A",) * 3])
def test_the_snapshot_ring_puts_each_ranks_keeper_on_another_host_wherever_it_can(hosts):
    mesh = Mesh(hosts)
    n = len(hosts)
    assert sorted(mesh.ring) == list(range(n))
    assert all(mesh.left(mesh.right(r)) == r for r in range(n))
    crossing = sum(hosts[r] != hosts[mesh.right(r)] for r in range(n))
    largest = max(hosts.count(h) for h in set(hosts))
    if largest <= n // 2:  # every rank's keeper on another host
        assert crossing == n
    elif len(set(hosts)) > 1:  # a host holds more than half: as many as its others can take
        assert crossing >= 2 * (n - largest)
    else:
        assert crossing == 0


def test_sums_over_each_dimension_and_two_levels_equal_the_flat_sum():
    hosts = ("A", "B", "A", "B")  # interleaved: a mesh takes the hosts in any order

    def rank_fn(group):
        value = float(2 ** group.rank)  # distinct bits: a sum names the ranks in it
        inside, across = group.subgroup("host"), group.subgroup("across")
        on_host = inside.all_reduce(torch.tensor([value]))
        over_hosts = across.all_reduce(torch.tensor([value]))
        two_level = across.all_reduce(inside.all_reduce(torch.tensor([value])))  # each host's sum, then theirs
        flat = group.all_reduce(torch.tensor([value]))
        return (inside.rank, inside.world_size, across.rank, float(on_host), float(over_hosts),
                float(two_level), float(flat), group.subgroup("host") is inside)

    results = run_ranks(4, rank_fn, hosts=hosts)
    # host A holds ranks 0 and 2 (1 + 4), host B ranks 1 and 3 (2 + 8); across pairs local index 0 (ranks 0, 1)
    # and local index 1 (ranks 2, 3)
    assert [r[:3] for r in results] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    assert [r[3] for r in results] == [5.0, 10.0, 5.0, 10.0]
    assert [r[4] for r in results] == [3.0, 3.0, 12.0, 12.0]
    assert all(r[6] == 15.0 for r in results) and all(r[5] == 15.0 for r in results)
    assert all(r[7] for r in results)  # built once per generation, then the same group


def test_an_abort_of_the_generation_releases_a_rank_blocked_in_its_sub_group_and_the_next_builds_anew():
    outcome: dict = {}
    done = threading.Event()

    def rank_fn(group):
        inside = group.subgroup("host")
        if group.rank == 1:
            outcome["first"] = inside
            done.wait(20)  # built the sub-group with rank 0, then never joins its all-reduce (alive)
            return None
        released = threading.Event()

        def blocked():
            try:
                inside.all_reduce(torch.ones(1000))
            except (RuntimeError, CollectiveError) as exc:
                outcome["error"] = exc
            released.set()

        thread = threading.Thread(target=blocked)
        thread.start()
        time.sleep(0.1)
        outcome["blocked"] = not released.is_set()
        start = time.perf_counter()
        group.abort()  # the generation's: its sub-groups with it
        outcome["released"] = released.wait(10)
        outcome["release_s"] = time.perf_counter() - start
        thread.join()
        done.set()
        return None

    run_ranks(2, rank_fn, hosts=("A", "A"))
    assert outcome["blocked"] and outcome["released"] and "error" in outcome
    assert outcome["release_s"] < 5

    def next_generation(group):
        inside = group.subgroup("host")
        return inside is not outcome["first"], inside.generation, float(inside.all_reduce(torch.ones(1)))

    assert run_ranks(2, next_generation, generation=1, hosts=("A", "A")) == [(True, 1, 2.0)] * 2


def test_a_sub_group_whose_peer_never_comes_is_ended_by_the_abort_and_not_left_half_built():
    outcome: dict = {}
    done = threading.Event()

    def rank_fn(group):
        if group.rank == 1:
            done.wait(20)  # alive, and never asks for the sub-group
            return
        timer = threading.Timer(0.2, group.abort)
        timer.start()
        start = time.perf_counter()
        with pytest.raises(CollectiveError, match="not every rank joined|aborted"):
            group.subgroup("host")
        outcome["ended_s"] = time.perf_counter() - start
        with pytest.raises(CollectiveError, match="aborted"):  # asked again: the abort, not a group half built
            group.subgroup("host")
        timer.join()
        done.set()

    run_ranks(2, rank_fn, hosts=("A", "A"))
    assert outcome["ended_s"] < 5


def test_a_sub_group_asked_for_by_an_earlier_generation_is_refused_not_built():
    def rank_fn(group):
        with pytest.raises(CollectiveError, match="a sub-group of generation 0 asked for in generation 1"):
            group.subgroup("host", generation=0)
        return group.subgroup("host", generation=1).world_size

    assert run_ranks(2, rank_fn, generation=1, hosts=("A", "A")) == [2, 2]


@pytest.mark.parametrize("hosts", ["AAAA", "AABB", "AAB", "ABC", "AABC", "A"])
def test_the_near_ring_stays_inside_a_host_and_pairs_every_rank_with_one_keeper(hosts):
    """A compressor's error copies (``Mesh.near_right``): a rank's keeper is on its host where
    the host has another rank, else another lone rank's host; left and right are inverse, so
    that every copy sent is received by exactly one rank."""
    mesh = Mesh(tuple(hosts))
    for rank in range(mesh.world_size):
        right = mesh.near_right(rank)
        assert mesh.near_left(right) == rank
        alone = hosts.count(hosts[rank]) == 1
        assert hosts[right] == hosts[rank] if not alone else hosts.count(hosts[right]) == 1
    lone = [r for r in range(len(hosts)) if hosts.count(hosts[r]) == 1]
    if len(lone) == 1:
        assert mesh.near_right(lone[0]) == lone[0]  # alone among lone ranks: no keeper, no copy
