"""Bucketed gradient reduction, launched from backward hooks (docs/sync.md, buckets).

Parameters are packed, last first, into buckets (``make_buckets``); in the last
micro-batch's backward each parameter's post-accumulate-grad hook marks it ready, and a
complete bucket starts an asynchronous SUM reduction while backward goes on. Buckets are
launched strictly in index order on every rank, since collectives match by order;
``finish()`` launches the rest (a parameter without a gradient adds zeros) and waits. Each
parameter's hook also marks it used, in every micro-batch's backward (``counting``), and
the ballot says which were (``Ballot.used``): a parameter no rank used gets no update
(``unused``; docs/sync.md, parameters without a gradient).

Three modes, one per ZeRO stage: all-reduce, with each ``param.grad`` a view into its
bucket's buffer where the dtypes allow (no copies; that is why gradients are zeroed here
between steps, not set to None); in-place reduce-scatter (stage 1: the buffers stay, and the rank's
own chunk of each receives the global gradient); and reduce-scatter into the caller's
chunks (stage 2: a bucket's full buffer lives from its launch to its reduction, and the
full gradients are released). Under ZeRO buckets never mix param groups and are padded
to a multiple of the reduction's chunk count (``Reduction.parts``: the world size, or a
block's ranks under HSDP), so that rank ``r`` owns the ``Reduction.part``-th of equal
chunks; the partition itself does not depend on the world size.

What each bucket's collective is, the reducer asks of its reduction
(``elastic_dp.comm.reductions``: ``AllReduce`` in the all-reduce mode, ``ReduceScatter`` in
the scatter modes, or a plug-in of the strategy's choosing); the buffers, the hooks and the
order of launches are the reducer's.

The losses are scaled so that the SUM over the ranks is the global-batch gradient
(docs/design.md, fixed global batch). The commit vote (``elastic_dp.comm.vote``) travels
in the last bucket where the reduction is a plain SUM (``Reduction.sums``): each rank's
``Ballot`` (its error, a non-finite loss or local gradient, a request to stop) follows the
bucket's buffer, or each rank's chunk of it in the scatter modes, so every rank receives
the whole tally with that bucket, and no collective is spent on the vote alone; under
another reduction it is sent on its own channel beside the last bucket (``Ballot.send``). A ballot's payload (``Ballot.payload``) is
all-reduced right after the last bucket is launched, and waited for with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reductions import AllReduce, ReduceScatter, Reduction
from elastic_dp.comm.vote import Ballot, Vote


@dataclass(slots=True)
class Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    """Where each parameter starts in the bucket's flat buffer."""
    numel: int
    """Elements of the parameters; the buffer has ``padded`` >= ``numel`` (zeros after)."""
    padded: int
    dtype: torch.dtype
    as_view: bool
    """The buffer has the parameters' dtype, so the views serve as their ``.grad``."""
    buffer: torch.Tensor | None = None
    carrier: torch.Tensor | None = None
    """The last bucket's reduced tensor: ``buffer`` followed by the vote (``buffer`` is a
    view of it); None for the others."""
    views: list[torch.Tensor] = field(default_factory=list)
    """Per parameter, its slice of ``buffer`` shaped like the parameter."""
    pending: int = 0
    ready: bool = False
    work: object | None = None
    seen: set[int] = field(default_factory=set)


class GradientReducer:
    """All-reduces gradients in buckets overlapped with backward."""

    def __init__(self, params: list[torch.nn.Parameter], group: CollectiveGroup, *,
                 bucket_bytes: int, reduce_fp32: bool, first_bucket_bytes: int | None = None,
                 group_of: dict[int, int] | None = None, pad_to: int = 1,
                 scatter_into: list[torch.Tensor] | None = None, scatter_in_place: bool = False,
                 buckets: list[Bucket] | None = None, reduction: Reduction | None = None) -> None:
        self.group = group
        scatters = scatter_into is not None or scatter_in_place
        self.reduction = reduction or (ReduceScatter(group) if scatters else AllReduce(group))
        """Each bucket's collective (``comm.reductions``)."""
        carries = self.reduction.sums  # the vote rides the last bucket's SUM
        self.buckets = buckets if buckets is not None else make_buckets(
            [p for p in params if p.requires_grad], bucket_bytes, reduce_fp32, first_bucket_bytes=first_bucket_bytes,
            group_of=group_of, pad_to=pad_to)
        """The buckets, in launch order (``buckets``: the caller's, such as ZeRO-3's units)."""
        self.reduction.bind(self.buckets)
        self.scatter_into = scatter_into
        if scatter_into is not None and scatter_in_place:
            raise ValueError("scatter_into and scatter_in_place exclude each other")
        if scatters and pad_to != self.reduction.parts:
            raise ValueError(f"a reduce-scatter into {self.reduction.parts} chunks needs buckets padded to that, "
                             f"not {pad_to}")
        device = self.buckets[-1].params[0].device if self.buckets else torch.device("cpu")
        self.params = [p for bucket in self.buckets for p in bucket.params]
        """The reduced parameters, in the order the ballot says which were used."""
        self.ballot = Ballot(device, len(self.params))
        """This rank's vote, filled in during the step."""
        self.chunks: list[torch.Tensor] | None = scatter_into
        """Scatter modes: per bucket, the chunk this rank receives (None: all-reduce mode)."""
        if scatter_into is not None:
            expected = [b.padded // pad_to for b in self.buckets]
            if [t.numel() for t in scatter_into] != expected:
                raise ValueError(f"scatter_into needs chunks of {expected} elements")
        else:
            for bucket in self.buckets:
                _attach(bucket, torch.zeros(bucket.padded, dtype=bucket.dtype, device=bucket.params[0].device),
                        carry_vote=self.ballot.size if bucket is self.buckets[-1] and not scatter_in_place and carries
                        else 0)
            if scatter_in_place:
                self.chunks = [b.buffer.view(pad_to, -1)[self.reduction.part] for b in self.buckets]
        self._sums = torch.zeros(len(self.buckets), dtype=torch.float32, device=device)
        """Per bucket, the sum of this rank's gradients (checked for NaN and infinity)."""
        self._tally = torch.zeros(self.ballot.size)
        self._used = [0] * len(self.params)  # per parameter: this step's backwards gave it a gradient
        self.counting = True
        """The backward under way counts in ``_used`` (not a pass that adds nothing: ``Replica.forward_backward``)."""
        self._payload: tuple[object, torch.Tensor] | None = None  # (work, summed payload) of this step
        self._vote: tuple[object, torch.Tensor] | None = None  # (work, summed ballot): the vote's own channel
        self._scatter_out: torch.Tensor | None = None  # scatter mode: the last chunk and the tally
        self._bucket_of: dict[int, int] = {}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = []
        for b, bucket in enumerate(self.buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = b
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._armed = False
        self._next = 0
        self.before_vote: Callable[[], None] | None = None
        """Called just before this rank's vote leaves with the last bucket: the last moment
        to ``ballot.stop()`` (the worker's window), and fault injection's ``allreduce`` phase
        (the other buckets are in flight, and the step commits on no rank)."""

    def close(self) -> None:
        """Remove the backward hooks (before another reducer takes over these parameters)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def zero_grad(self) -> None:
        """Zero every gradient (the views stay attached as ``param.grad``) and the vote."""
        self.ballot.clear()
        self._used = [0] * len(self.params)
        self.counting = True
        for bucket in self.buckets:
            if self.scatter_into is not None:
                bucket.buffer, bucket.views = None, []
                for p in bucket.params:
                    p.grad = None
                continue
            (bucket.carrier if bucket.carrier is not None else bucket.buffer).zero_()
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view if bucket.as_view else None

    def arm(self) -> None:
        """Reduce during the next backward (the last micro-batch of a step).

        A no-op when already armed, so a step that failed part-way through its last
        backward can call it again and still launch every bucket exactly once.
        """
        if self._armed:
            return
        self._armed = True
        self._next = 0
        self.reduction.follow()  # a new generation: the reduction's state re-cut for it
        for bucket in self.buckets:
            bucket.pending, bucket.ready, bucket.work = len(bucket.params), False, None
            bucket.seen.clear()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if self.counting:  # in every micro-batch's backward: a gradient in any makes it used
            self._used[self._index[id(param)]] = 1
        if not self._armed:
            return
        bucket = self.buckets[self._bucket_of[id(param)]]
        if id(param) in bucket.seen:  # a parameter used twice fires once per use
            return
        bucket.seen.add(id(param))
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready = True
            self._launch_ready()

    def settle(self, params: list[torch.nn.Parameter]) -> None:
        """``params`` will get no more gradient in this backward: those still pending count
        as ready (adding zeros), and their buckets launch in order once complete (ZeRO-3:
        at the same point on every rank, whichever parameters a rank's samples used)."""
        if not self._armed:
            return
        for param in params:
            bucket = self.buckets[self._bucket_of[id(param)]]
            if id(param) not in bucket.seen:
                bucket.seen.add(id(param))
                bucket.pending -= 1
                bucket.ready = bucket.pending == 0
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        if self.scatter_into is not None:  # each view is written below; only the padding is zeroed here
            _attach(bucket, torch.empty(bucket.padded, dtype=bucket.dtype, device=bucket.params[0].device))
            bucket.buffer[bucket.numel:].zero_()
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
        self._sums[index] = bucket.buffer.sum(dtype=torch.float32)  # non-finite if any element is
        last = index == len(self.buckets) - 1
        if last:  # this rank's gradients: a NaN or an infinity anywhere votes to skip
            if self.before_vote is not None:
                self.before_vote()
            self.ballot.nonfinite((~torch.isfinite(self._sums)).any())
            self.ballot.used(self._used)
        if self.scatter_into is not None:
            for p in bucket.params:
                p.grad = None  # the full gradient is in the buffer now; release it
        carry = last and self.reduction.sums
        if self.chunks is not None:
            if carry:  # every rank's chunk followed by the vote: each rank receives the tally
                world = bucket.padded // self.chunks[index].numel()
                source = torch.cat([bucket.buffer.view(world, -1),
                                    self.ballot.tensor.to(bucket.dtype).expand(world, self.ballot.size)], dim=1)
                self._scatter_out = torch.empty(source.shape[1], dtype=bucket.dtype, device=source.device)
                bucket.work = self.reduction.launch(index, source.view(-1), self._scatter_out)
            else:  # in place: the chunk may be the rank's own part of the buffer
                bucket.work = self.reduction.launch(index, bucket.buffer, self.chunks[index])
        elif carry:
            bucket.carrier[bucket.padded:] = self.ballot.tensor
            bucket.work = self.reduction.launch(index, bucket.carrier)
        else:
            bucket.work = self.reduction.launch(index, bucket.buffer)
        if last:  # right behind the vote (or the bucket), on every rank alike
            self._vote, self._payload = self.reduction.cast(self.ballot, carried=carry)

    def finish(self) -> Vote:
        """Launch the buckets backward did not, wait for all; gradients are then global.
        Returns the vote summed over the ranks, which the last bucket carried."""
        for bucket in self.buckets[self._next:]:
            bucket.ready = True
        self._launch_ready()
        self._armed = False
        for index, bucket in enumerate(self.buckets):
            bucket.work.wait()
            if self.chunks is not None:  # the reduced chunk is in self.chunks[index]
                if self._scatter_out is not None and index == len(self.buckets) - 1:
                    chunk = self.chunks[index]
                    chunk.copy_(self._scatter_out[:chunk.numel()])
                    self._tally = self._scatter_out[chunk.numel():]
                    self._scatter_out = None
                if self.scatter_into is not None:
                    bucket.buffer, bucket.views = None, []
                continue  # in place: the gradients stay the views (global in the chunk only)
            if bucket.carrier is not None:
                self._tally = bucket.carrier[bucket.padded:]
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                    continue
                if bucket.as_view:
                    p.grad = view
                elif p.grad is None:
                    p.grad = view.to(p.dtype)
                else:
                    p.grad.copy_(view)
        if not self.buckets:  # nothing to reduce: the vote is this rank's alone
            if self.before_vote is not None:
                self.before_vote()
            return self.ballot.alone() if self.group.world_size == 1 else self.ballot.cast(self.group)
        if self._vote is not None:
            work, self._tally = self._vote
            self._vote = None
            work.wait()
        payload = None
        if self._payload is not None:
            work, payload = self._payload
            self._payload = None
            work.wait()
        return Vote.of(self._tally, payload)

    def unused(self, vote: Vote) -> list[torch.nn.Parameter]:
        """The parameters no rank's step gave a gradient (``vote``: the step's, from ``finish``)."""
        return [p for i, p in enumerate(self.params) if vote.unused(i)]

    def disarm(self) -> None:
        """Forget a step that failed part-way; the next ``arm()`` starts clean."""
        self._armed = False
        self._scatter_out = None
        self._payload = None
        self._vote = None
        if self.scatter_into is not None:
            for bucket in self.buckets:
                bucket.buffer, bucket.views = None, []


def _attach(bucket: Bucket, buffer: torch.Tensor, carry_vote: int = 0) -> None:
    if carry_vote:  # the buffer is followed by the vote (``carry_vote`` elements), reduced with it
        bucket.carrier = torch.zeros(buffer.numel() + carry_vote, dtype=buffer.dtype, device=buffer.device)
        buffer = bucket.carrier[:buffer.numel()]
    bucket.buffer = buffer
    bucket.views = [buffer[o:o + p.numel()].view_as(p) for p, o in zip(bucket.params, bucket.offsets)]


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int, reduce_fp32: bool, *,
                 first_bucket_bytes: int | None = None, group_of: dict[int, int] | None = None,
                 pad_to: int = 1, dtype_of: Callable[[torch.nn.Parameter], torch.dtype] | None = None) -> list[Bucket]:
    """Pack ``params``, last first, into buckets of about ``bucket_bytes``; the first closes
    at ``first_bucket_bytes`` already, where given (``TrainConfig.first_bucket_bytes``). No
    buffers yet.

    A bucket holds parameters of one dtype on one device and, with ``group_of``
    (``id(param)`` -> param group), of one param group. Each such kind has one open
    bucket, filled in reverse registration order and closed when full, so parameters of
    different kinds that alternate in the model (weights and biases in a weight-decay
    split) do not cut each other's buckets short; buckets are ordered by when they were
    closed, roughly when backward completes them, and the last, partly filled ones come
    last. The partition does not depend on ``pad_to``: only each bucket's padded length
    does, so buckets keep their identity when the world size changes. ``dtype_of``: the
    dtype each parameter's gradients will have, where it is not the dtype it has now
    (ZeRO-3's ``--param-dtype bf16``: fp32 parameters gathered and computed in bf16).
    """
    def compute_dtype(p: torch.nn.Parameter) -> torch.dtype:
        return p.dtype if dtype_of is None else dtype_of(p)

    def buffer_dtype(p: torch.nn.Parameter) -> torch.dtype:
        if reduce_fp32 and compute_dtype(p) in (torch.bfloat16, torch.float16):
            return torch.float32
        return compute_dtype(p)

    def kind(p: torch.nn.Parameter) -> tuple:
        return compute_dtype(p), buffer_dtype(p), p.device, (group_of or {}).get(id(p))

    def bucket(members: list[torch.nn.Parameter]) -> Bucket:
        dtype = buffer_dtype(members[0])
        offsets, offset = [], 0
        for p in members:
            offsets.append(offset)
            offset += p.numel()
        return Bucket(params=members, offsets=offsets, numel=offset, padded=-(-offset // pad_to) * pad_to,
                      dtype=dtype, as_view=all(compute_dtype(p) == dtype for p in members))

    first = bucket_bytes if first_bucket_bytes is None else min(bucket_bytes, first_bucket_bytes)
    buckets: list[Bucket] = []
    open_: dict[tuple, tuple[list[torch.nn.Parameter], int]] = {}  # kind -> (params, bytes); insertion-ordered
    for p in reversed(params):
        members, size = open_.pop(kind(p), ([], 0))
        members.append(p)
        size += p.numel() * torch.empty((), dtype=buffer_dtype(p)).element_size()
        if size >= (bucket_bytes if buckets else first):
            buckets.append(bucket(members))
        else:
            open_[kind(p)] = (members, size)  # re-inserted: open buckets stay ordered by last use
    buckets.extend(bucket(members) for members, _ in open_.values())
    return buckets
