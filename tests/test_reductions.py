"""Reductions as plug-ins (elastic_dp.comm.reductions): the reducer hands each bucket to
its reduction, and the commit vote rides a plain SUM's last bucket or, under a reduction
that is not one, a channel of its own; the wire dtype of an all-reduce (DiLoCo's
--outer-reduce bf16) against the sum of the rounded values. On gloo ranks run as threads,
against the sums computed here."""

from __future__ import annotations

import dataclasses
import threading
import time
import types

import numpy as np
import pytest
import torch

from elastic_dp.comm.mesh import Mesh
from elastic_dp.comm.reducer import GradientReducer, make_buckets
from elastic_dp.comm.reductions import AllReduce, Hierarchical, ReduceScatter, ReductionThread, all_reduce
from elastic_dp.errors import CollectiveError
from elastic_dp.modes.sync.program import SyncProgram
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.reference import max_abs_diff
from tests.tasks import MLP_TASK
from tests.test_reducer import PartlyUsed


class Recorded:
    """A reduction's launches, by bucket: the elements each sent (the vote's tail included)."""

    def __init__(self, reduction):
        self.inner, self.sent = reduction, {}
        self.sums = reduction.sums

    def launch(self, index, tensor, out=None):
        self.sent[index] = tensor.numel()
        return self.inner.launch(index, tensor, out)

    def __getattr__(self, name):  # the rest of the interface is the inner reduction's
        return getattr(self.inner, name)


class NotASum(AllReduce):
    """An all-reduce that says its result is not a plain sum (as a compressor's is not)."""

    sums = False


@pytest.mark.parametrize("kind", ["allreduce", "notasum", "reducescatter"])
def test_each_bucket_goes_through_the_reduction_and_the_vote_rides_only_a_plain_sum(kind):
    torch.manual_seed(0)
    initial = PartlyUsed().state_dict()
    world = 3

    def rank_fn(group):
        model = PartlyUsed()
        model.load_state_dict(initial)
        params = list(model.parameters())
        scatter = kind == "reducescatter"
        inner = {"allreduce": AllReduce, "notasum": NotASum, "reducescatter": ReduceScatter}[kind](group)
        reduction = Recorded(inner)
        pad = world if scatter else 1
        reducer = GradientReducer(params, group, bucket_bytes=100, reduce_fp32=True, pad_to=pad,
                                  scatter_in_place=scatter, reduction=reduction)
        reducer.zero_grad()
        if group.rank == 1:
            reducer.ballot.error()  # every rank must hear of it, by whichever channel
        reducer.arm()
        model(torch.full((2, 6), float(group.rank + 1))).sum().backward()
        vote = reducer.finish()
        grads = [c.clone() for c in reducer.chunks] if scatter else [b.buffer.clone() for b in reducer.buckets]
        return vote.errors, reduction.sent, [b.padded for b in reducer.buckets], grads

    results = run_ranks(world, rank_fn)
    model = PartlyUsed()
    model.load_state_dict(initial)
    for rank in range(world):
        model(torch.full((2, 6), float(rank + 1))).sum().backward()
    for n, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets = make_buckets(list(model.parameters()), 100, True, pad_to=world if kind == "reducescatter" else 1)
    expected = []
    for b in buckets:  # each bucket's sum, flattened as the reducer packs it
        flat = torch.zeros(b.padded)
        for p, o in zip(b.params, b.offsets):
            flat[o:o + p.numel()] = p.grad.reshape(-1)
        expected.append(flat)
    last = len(buckets) - 1
    params = list(model.parameters())
    for rank, (errors, sent, padded, grads) in enumerate(results):
        assert errors == 1  # rank 1's error reached every rank
        assert sorted(sent) == list(range(len(buckets)))  # every bucket through the reduction, once
        tail = sent[last] - padded[last]
        if kind == "notasum":
            assert tail == 0  # the vote went on its own channel
        else:
            ballot = 3 + len(params)  # the 3 counts and one use flag per parameter rode along
            assert tail == (ballot * world if kind == "reducescatter" else ballot)
        for b, got in enumerate(grads):
            want = expected[b].view(world, -1)[rank] if kind == "reducescatter" else expected[b]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # measured 0 (3 runs)


def test_an_all_reduce_in_bf16_is_the_sum_of_the_rounded_values_copied_back_in_fp32():
    values = [torch.tensor([1.0 + 2 ** -10, 3.0, -0.1]), torch.tensor([2 ** -12, 1.0, 0.2])]

    def rank_fn(group):
        reduction = AllReduce(group, wire_dtype=torch.bfloat16)
        tensor = values[group.rank].clone()
        handle = reduction.launch(0, tensor)
        handle.wait()
        return tensor, reduction.wire_bytes(tensor), AllReduce(group).wire_bytes(tensor)

    expected = (values[0].bfloat16() + values[1].bfloat16()).float()  # gloo sums the bf16 tensors in bf16
    for tensor, bf16_bytes, fp32_bytes in run_ranks(2, rank_fn):
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0)
        assert bf16_bytes * 2 == fp32_bytes == 12
    assert not torch.equal(expected, values[0] + values[1])  # the rounding shows: the test could fail


class Counting(AllReduce):
    """A reduction with state: the launches it made on committed steps (as a compressor's
    error feedback is state that a step which does not commit must not change)."""

    def __init__(self, group):
        super().__init__(group)
        self.count, self.kept, self.resized = torch.zeros(()), None, []

    def launch(self, index, tensor, out=None):
        self.count += 1
        return super().launch(index, tensor, out)

    def state(self):
        return {"count": self.count.clone()}

    def save(self):
        self.kept = self.count.clone()

    def restore(self):
        self.count = self.kept.clone()

    def resize(self, world_size):
        self.resized.append(world_size)


def test_a_step_that_does_not_commit_leaves_the_reduction_s_state_as_it_was_before_it():
    def raising(model, batch):
        raise RuntimeError("the task's loss failed")

    task = MLP_TASK

    def rank_fn(group):
        program = SyncProgram(Replica(task, MLP_TASK.defaults, torch.device("cpu"), group))
        program.replica.broadcast_state(0)
        strategy = program.replica.strategy
        reducer = strategy.reducer
        strategy.reduction = reducer.reduction = counting = Counting(group)  # as a strategy builds its own
        buckets = len(reducer.buckets)
        first = program.step(0, np.arange(4) + 4 * group.rank)
        after_first = float(counting.count)
        if group.rank == 1:  # this rank's forward raises: the step commits on no rank
            program.replica.task = dataclasses.replace(task, loss=raising)
        failed = program.step(1, np.arange(4) + 4 * group.rank)
        program.replica.task = task
        after_failed = float(counting.count)
        again = program.step(1, np.arange(4) + 4 * group.rank)
        return first.committed, failed.committed, again.committed, buckets, after_first, after_failed, \
            float(counting.count), counting.resized

    for committed0, failed, committed1, buckets, after_first, after_failed, final, resized in run_ranks(2, rank_fn):
        assert committed0 and not failed and committed1
        assert after_first == buckets  # one launch a bucket
        assert after_failed == after_first  # the failed step's launches were undone with it
        assert final == 2 * buckets
        assert resized == [2]  # told of the generation once, before its first step


class Rowed:
    """A state of a rank's own (as error feedback is), on top of the strategy's reduction."""

    def __init__(self, group):
        super().__init__(group)
        self.value = torch.full((2, 3), -1.0)

    def state(self):
        return {"residual": self.value.clone()}

    def load_state(self, state):
        self.value = state["residual"].clone() if state else torch.zeros(2, 3)


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_a_reduction_s_state_is_saved_a_row_a_rank_and_comes_back_at_the_saved_world_size_only(zero, tmp_path):
    """Saved at 2 ranks after a step, each rank's state its own (rank + 1 everywhere);
    resumed at 2 ranks each takes its row back, at 3 it starts fresh. The strategies'
    loaders leave the rows alone: the model and optimizer state the resumed ranks hold are
    the saved ones (stage 0, 2 and 3 each read the optimizer state their own way)."""
    from elastic_dp.durable.checkpoint import CheckpointStore, manifest_of, write_part

    config = dataclasses.replace(MLP_TASK.defaults, zero=zero, micro_batch=None)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    directory = store.begin(1)

    def build(group):
        program = SyncProgram(Replica(MLP_TASK, config, torch.device("cpu"), group))
        strategy = program.replica.strategy
        rowed = type("RowedReduction", (Rowed, type(strategy.reduction)), {})  # AllReduce or ReduceScatter
        strategy.reduction = rowed(group)  # as a strategy builds its own: a sharded one's reducers take it
        if hasattr(strategy, "reducer"):  # stage 0's reducer is built with it
            strategy.reducer.reduction = strategy.reduction
        return program

    def save(group):
        program = build(group)
        program.replica.broadcast_state(0)
        assert program.step(0, np.arange(4) + 4 * group.rank).committed
        program.replica.strategy.reduction.value.fill_(group.rank + 1.0)
        part = program.checkpoint_part(1, {"seed": config.seed})
        return write_part(store.storage, directory, part), program.replica.model_state(), \
            program.replica.training_state(1, {"seed": config.seed})

    saved = run_ranks(2, save)
    checkpoint = store.commit(directory, manifest_of([s[0] for s in saved], step=1, sampler={"seed": config.seed},
                                                     world_size=2))
    assert checkpoint.manifest["tensors"]["optim/reduction/residual"]["shape"] == [2, 2, 3]

    def resume(group):
        program = build(group)
        program.load_checkpoint(checkpoint)
        loaded = program.replica.strategy.reduction.value.clone()
        state, model = program.replica.training_state(1, {"seed": config.seed}), program.replica.model_state()
        stepped = program.step(1, np.arange(4) + 4 * group.rank).committed  # the optimizer state loaded whole
        return loaded, model, state, stepped

    for world in (2, 3):
        for rank, (value, model, state, stepped) in enumerate(run_ranks(world, resume)):
            expected = torch.full((2, 3), rank + 1.0) if world == 2 else torch.zeros(2, 3)
            assert torch.equal(value, expected), (world, rank, value)
            assert max_abs_diff(model, saved[0][1]) == 0.0 and stepped
            assert not any(k.startswith("reduction/") for k in state.optimizer_tensors)
            if world == 2:  # each rank's share of the optimizer state, as it was saved
                assert max_abs_diff(state.optimizer_tensors, saved[rank][2].optimizer_tensors) == 0.0


@pytest.mark.parametrize("hosts", [("A", "A", "B", "B"), ("A", "A", "B", "B", "B"), ("A", "A", "B"),
                                   ("A", "B", "B", "C")])
def test_the_hierarchical_all_reduce_sums_like_the_flat_one_on_even_and_uneven_hosts(hosts):
    """Integer-valued floats: every order of summing gives the exact sum, so the two compare
    with ==; 1,003 elements do not divide into the pieces, and the last bucket carries the vote."""
    world = len(hosts)

    def rank_fn(group):
        torch.manual_seed(group.rank)
        tensors = [torch.randint(-50, 50, (n,)).float() for n in (1003, 7, 1)]
        reduction = Hierarchical(group)
        got = [t.clone() for t in tensors]
        handles = [reduction.launch(i, t) for i, t in enumerate(got)]
        for h in handles:
            h.wait()
        flat = [group.all_reduce(t.clone()) for t in tensors]
        return reduction.active(), [torch.equal(g, f) for g, f in zip(got, flat)], sorted(group._subs)

    results = run_ranks(world, rank_fn, hosts=hosts)
    assert all(active and all(equal) for active, equal, _ in results)
    # the host's group and the across groups of the pieces this rank owns, no others
    mesh = Mesh(hosts)
    for rank, (_, _, subs) in enumerate(results):
        assert subs == sorted([f"host/{mesh.index('host', rank)}", *(f"across/{i}" for i in mesh.owned(rank))])


def test_the_reducer_with_the_hierarchical_all_reduce_gives_the_flat_gradients_and_the_vote():
    torch.manual_seed(0)
    initial = PartlyUsed().state_dict()

    def rank_fn(group):
        results = []
        for reduction in (AllReduce(group), Hierarchical(group)):
            model = PartlyUsed()
            model.load_state_dict(initial)
            reducer = GradientReducer(list(model.parameters()), group, bucket_bytes=100, reduce_fp32=True,
                                      reduction=reduction)
            reducer.zero_grad()
            reducer.arm()
            x = torch.full((2, 6), float(group.rank + 1))
            model(x).sum().backward()
            if group.rank == 2:
                reducer.ballot.stop()
            vote = reducer.finish()
            results.append(({n: p.grad.clone() for n, p in model.named_parameters()}, vote.stop))
            reducer.close()
        return results

    for (flat, flat_stop), (hier, hier_stop) in run_ranks(4, rank_fn, hosts=("A", "A", "B", "B")):
        assert max_abs_diff(flat, hier) < 1e-6 and flat_stop and hier_stop  # measured 1.2e-7 (3 runs): 8x


def test_all_reduce_chooses_flat_or_hierarchical_by_the_setting_and_the_mesh():
    def rank_fn(group):
        auto, forced, flat = all_reduce(group, None), all_reduce(group, "hierarchical"), all_reduce(group, "flat")
        return auto.active(), forced.active(), type(flat).__name__

    assert run_ranks(4, rank_fn, hosts=("A", "A", "B", "B"))[0] == (True, True, "AllReduce")
    assert run_ranks(2, rank_fn, hosts=("A", "B"))[0] == (False, True, "AllReduce")  # one rank a host: flat
    assert run_ranks(2, rank_fn, hosts=("A", "A"))[0] == (False, True, "AllReduce")  # one host: flat


def test_a_bucket_of_an_earlier_generation_does_not_meet_the_next_ones_groups():
    def launched_then_moved(group):
        reduction = Hierarchical(group)
        group.generation = 1  # the group moved on before a bucket launched in generation 0 had its turn
        with pytest.raises(CollectiveError, match="launched in generation 0 met generation 1"):
            reduction._reduce(torch.ones(10), 0)
        group.generation = 0
        return True

    assert all(run_ranks(2, launched_then_moved, hosts=("A", "A")))


def test_a_launch_of_the_next_generation_does_not_wait_behind_one_of_the_last():
    """A reduction's thread runs launches in order within a generation; a launch of generation 0
    still running (a collective no abort reached) does not hold generation 1's: those start on
    a thread of their own, while the old one finishes its queue."""
    group = types.SimpleNamespace(generation=0)
    thread = ReductionThread("edp-test", lambda: group.generation)
    release, order = threading.Event(), []
    stuck = thread.submit(lambda: (release.wait(30), order.append("gen 0, first")))
    queued = thread.submit(lambda: order.append("gen 0, second"))  # behind the first: launch order
    start = time.perf_counter()
    group.generation = 1
    thread.submit(lambda: order.append("gen 1")).wait()
    assert time.perf_counter() - start < 5.0 and order == ["gen 1"]
    release.set()
    stuck.wait()
    queued.wait()
    assert order == ["gen 1", "gen 0, first", "gen 0, second"]
