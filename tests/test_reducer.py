"""The bucketed all-reduce and the commit vote, on gloo ranks run as threads (no Ray)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

from elastic_dp import TaskError, TrainConfig
from elastic_dp.comm.reducer import GradientReducer, make_buckets
from elastic_dp.comm.vote import Vote
from elastic_dp.modes.sync.program import SyncProgram
from elastic_dp.task import Task
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.tasks import Regression, mlp, mse, sgd_two_groups


class PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.unused, self.b = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Branches(nn.Module):
    """Rank 0's samples go through ``a`` only, rank 1's through ``a`` and ``b``; ``c`` is never used."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 1), nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x, rank):
        return self.a(x) + (self.b(x) if rank == 1 else 0)


@pytest.mark.parametrize("scatter", [False, True])
def test_the_vote_says_which_parameters_some_rank_used_and_a_partly_used_one_gets_the_users_sum(scatter):
    torch.manual_seed(0)
    initial = Branches().state_dict()

    def rank_fn(group):
        model = Branches()
        model.load_state_dict(initial)
        reducer = GradientReducer(list(model.parameters()), group, bucket_bytes=10**6, reduce_fp32=True,
                                  scatter_in_place=scatter, pad_to=group.world_size if scatter else 1)
        reducer.zero_grad()
        x = torch.full((2, 4), float(group.rank + 1))
        reducer.counting = False  # a pass that adds nothing (ZeRO-3's equal passes) marks nothing used
        (model(x, 1).sum() * 0).backward()
        reducer.counting = True
        reducer.arm()
        model(x, group.rank).sum().backward()
        vote = reducer.finish()
        names = {id(p): n for n, p in model.named_parameters()}
        full = None if scatter else {n: p.grad.clone() for n, p in model.named_parameters()}
        return vote.uses, [names[id(p)] for p in reducer.unused(vote)], [names[id(p)] for p in reducer.params], full

    results = run_ranks(2, rank_fn)
    uses, unused, order, full = results[0]
    assert all(r[:3] == (uses, unused, order) for r in results)  # every rank knows the same
    counts = dict(zip(order, uses))
    assert counts == {"a.weight": 2, "a.bias": 2, "b.weight": 1, "b.bias": 1, "c.weight": 0, "c.bias": 0}
    assert sorted(unused) == ["c.bias", "c.weight"]
    if not scatter:  # b's gradient is rank 1's alone: x = 2, two samples
        assert torch.equal(full["b.weight"], torch.full((1, 4), 4.0))
        assert torch.equal(full["b.bias"], torch.full((1,), 2.0))


@pytest.mark.parametrize("grads_as_views", [True, False])
@pytest.mark.parametrize("bucket_bytes", [1, 100, 10**6])
def test_bucketed_gradients_equal_the_sum_over_ranks(bucket_bytes, grads_as_views):
    torch.manual_seed(0)
    initial = PartlyUsed().state_dict()  # built once: the ranks are threads sharing one RNG

    def rank_fn(group):
        model = PartlyUsed()
        model.load_state_dict(initial)
        reducer = GradientReducer(list(model.parameters()), group, bucket_bytes=bucket_bytes, reduce_fp32=True)
        if grads_as_views:
            reducer.zero_grad()  # else grads start as None and are copied into the buckets
        x = torch.full((3, 6), float(group.rank + 1))
        for i, micro_batch in enumerate((x[:1], x[1:])):  # accumulation over two micro-batches
            if i == 1:
                reducer.arm()
            model(micro_batch).sum().backward()
        reducer.finish()
        in_place = all(p.grad.data_ptr() == v.data_ptr() for b in reducer.buckets
                       for p, v in zip(b.params, b.views))
        assert in_place, "after finish every gradient is the bucket view"
        return len(reducer.buckets), {n: p.grad.clone() for n, p in model.named_parameters()}

    results = run_ranks(3, rank_fn)
    model = PartlyUsed()
    model.load_state_dict(initial)
    for rank in range(3):
        model(torch.full((3, 6), float(rank + 1))).sum().backward()
    for n, p in model.named_parameters():
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        for _, grads in results:
            torch.testing.assert_close(grads[n], expected, rtol=1e-5, atol=1e-5)  # measured 4.8e-7 (3 runs)
    assert results[0][0] == {1: 6, 100: 2, 10**6: 1}[bucket_bytes]


@pytest.mark.parametrize("in_place", [True, False])
def test_reduce_scatter_gives_each_rank_its_chunk_of_the_sum_and_every_rank_the_vote(in_place):
    """The ZeRO modes: stage 1 reduce-scatters into its own part of buffers that stay (the
    gradients stay views into them), stage 2 into chunks of its own; in both each rank's
    chunk is that chunk of the sum over the ranks, and the vote reaches every rank."""
    torch.manual_seed(0)
    initial = PartlyUsed().state_dict()
    world = 3

    def rank_fn(group):
        model = PartlyUsed()
        model.load_state_dict(initial)
        params = list(model.parameters())
        padded = [b.padded for b in make_buckets(params, 100, True, pad_to=world)]
        chunks = None if in_place else [torch.full((n // world,), float("nan")) for n in padded]
        reducer = GradientReducer(params, group, bucket_bytes=100, reduce_fp32=True, pad_to=world,
                                  scatter_into=chunks, scatter_in_place=in_place)
        reducer.zero_grad()
        if group.rank == 1:
            reducer.ballot.error()
        reducer.arm()
        model(torch.full((3, 6), float(group.rank + 1))).sum().backward()
        tally = reducer.finish()
        pairs = [(p, v) for b in reducer.buckets for p, v in zip(b.params, b.views)]
        views = len(pairs) == len(params) and all(p.grad is not None and p.grad.data_ptr() == v.data_ptr()
                                                  for p, v in pairs)
        released = all(p.grad is None for p in params)
        names = {id(p): n for n, p in model.named_parameters()}
        layout = [([names[id(p)] for p in b.params], b.offsets, b.padded) for b in reducer.buckets]
        buffers = [b.buffer.clone() for b in reducer.buckets] if in_place else None
        return tally, [c.clone() for c in reducer.chunks], views, released, layout, buffers

    results = run_ranks(world, rank_fn)
    local = []  # per rank, its own gradients
    for rank in range(world):
        model = PartlyUsed()
        model.load_state_dict(initial)
        model(torch.full((3, 6), float(rank + 1))).sum().backward()
        local.append({n: p.grad for n, p in model.named_parameters()})

    def flat(grads, names, offsets, padded):
        out = torch.zeros(padded)
        for name, offset in zip(names, offsets):
            if grads[name] is not None:  # "unused" has none: zeros
                out[offset:offset + grads[name].numel()] = grads[name].reshape(-1)
        return out

    for rank, (tally, chunks, views, released, layout, buffers) in enumerate(results):
        assert tally == Vote(errors=1)  # rank 1's error, known on every rank
        assert (views, released) == ((True, False) if in_place else (False, True))
        assert len(layout) == 2
        for b, ((names, offsets, padded), chunk) in enumerate(zip(layout, chunks)):
            total = sum(flat(grads, names, offsets, padded) for grads in local)
            n = padded // world
            mine = slice(rank * n, (rank + 1) * n)
            torch.testing.assert_close(chunk, total[mine], rtol=1e-5, atol=1e-5)  # measured 0 (3 runs)
            if in_place:  # the chunk is the buffer's own part; the rest is not reduced
                own = flat(local[rank], names, offsets, padded)
                own[mine] = total[mine]
                torch.testing.assert_close(buffers[b], own, rtol=1e-5, atol=1e-5)  # measured 0


def test_the_first_bucket_closes_at_first_bucket_bytes_and_the_others_at_bucket_bytes():
    model = PartlyUsed()
    names = {id(p): n for n, p in model.named_parameters()}

    def partition(**sizes):
        return [[names[id(p)] for p in b.params] for b in make_buckets(list(model.parameters()), reduce_fp32=True,
                                                                      **sizes)]

    # last first: b.bias 4 bytes, b.weight 24, unused.bias 24, unused.weight 144, a.bias 24, a.weight 144
    assert partition(bucket_bytes=10**6) == [["b.bias", "b.weight", "unused.bias", "unused.weight", "a.bias",
                                              "a.weight"]]
    assert partition(bucket_bytes=10**6, first_bucket_bytes=100) == [
        ["b.bias", "b.weight", "unused.bias", "unused.weight"], ["a.bias", "a.weight"]]
    assert partition(bucket_bytes=30, first_bucket_bytes=100) == [  # never past bucket_bytes
        ["b.bias", "b.weight", "unused.bias"], ["unused.weight"], ["a.bias", "a.weight"]]


def test_a_rank_whose_loss_fails_makes_every_rank_skip_the_update():
    local = threading.local()  # the ranks are threads; each knows its own rank

    def bad_on_rank_1(model, batch):
        x, y = batch
        if local.rank == 1:
            return ((model(x) - y) ** 2).squeeze(-1)  # not a scalar, on rank 1 only
        return mse(model, batch)

    task = Task(model=mlp, dataset=Regression, loss=bad_on_rank_1, optimizer=sgd_two_groups)
    config = TrainConfig(global_batch=8, micro_batch=2)

    def rank_fn(group):
        replica = Replica(task, config, torch.device("cpu"), group)
        program = SyncProgram(replica)
        before = [p.detach().clone() for p in replica.model.parameters()]
        local.rank = group.rank
        result = program.step(0, np.array_split(np.arange(8), 2)[group.rank])
        unchanged = all(torch.equal(a, b) for a, b in zip(before, replica.model.parameters()))
        return result, unchanged

    (r0, unchanged0), (r1, unchanged1) = run_ranks(2, rank_fn)
    assert not r0.committed and not r1.committed
    assert unchanged0 and unchanged1
    assert r0.error is None and isinstance(r1.error, TaskError)


@pytest.mark.parametrize("reduce_fp32", [True, False])
def test_bf16_gradients_are_reduced_in_fp32_when_asked(reduce_fp32):
    torch.manual_seed(0)
    initial = nn.Linear(64, 64).to(torch.bfloat16).state_dict()

    def rank_fn(group):
        model = nn.Linear(64, 64).to(torch.bfloat16)
        model.load_state_dict(initial)
        reducer = GradientReducer(list(model.parameters()), group, bucket_bytes=10**6, reduce_fp32=reduce_fp32)
        reducer.zero_grad()
        reducer.arm()
        model(torch.full((2, 64), 0.1 * (group.rank + 1), dtype=torch.bfloat16)).sum().backward()
        reducer.finish()
        reduced = next(v for b in reducer.buckets for p, v in zip(b.params, b.views) if p is model.weight)
        return [b.buffer.dtype for b in reducer.buckets], model.weight.grad.dtype, reduced.clone()

    results = run_ranks(3, rank_fn)
    expected = torch.zeros(64, 64)  # the ranks' bf16 gradients summed exactly, in fp32
    for rank in range(3):
        model = nn.Linear(64, 64).to(torch.bfloat16)
        model.load_state_dict(initial)
        model(torch.full((2, 64), 0.1 * (rank + 1), dtype=torch.bfloat16)).sum().backward()
        expected += model.weight.grad.float()
    for buffer_dtypes, grad_dtype, reduced in results:
        assert buffer_dtypes == [torch.float32 if reduce_fp32 else torch.bfloat16]
        assert grad_dtype == torch.bfloat16
        tol = 1e-6 if reduce_fp32 else 1e-2  # measured 0 in fp32; 9.8e-4 in bf16 (3 runs)
        torch.testing.assert_close(reduced.float(), expected, rtol=0, atol=tol)


def test_a_failure_inside_the_last_backward_still_launches_each_bucket_once():
    class FailsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("boom in backward")

    torch.manual_seed(0)
    initial = PartlyUsed().state_dict()

    def rank_fn(group):
        model = PartlyUsed()
        model.load_state_dict(initial)
        reducer = GradientReducer(list(model.parameters()), group, bucket_bytes=1, reduce_fp32=True)
        reducer.zero_grad()
        reducer.arm()
        hidden = torch.relu(model.a(torch.ones(2, 6)))
        if group.rank == 1:  # b's gradients arrive (their buckets launch), then backward fails
            hidden = FailsInBackward.apply(hidden)
        try:
            model.b(hidden).sum().backward()
        except RuntimeError:
            reducer.arm()  # what the worker's error path does
        reducer.finish()  # must neither hang nor mismatch the peer's collectives
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    r0, r1 = run_ranks(2, rank_fn)
    torch.testing.assert_close(r0["b.weight"], r1["b.weight"])
    assert torch.equal(r0["a.weight"], r1["a.weight"])  # rank 1 sent zeros for a
