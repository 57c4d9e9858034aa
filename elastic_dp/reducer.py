"""Bucketed gradient all-reduce, launched from backward hooks.

Parameters are packed, in reverse registration order (roughly the order backward
produces their gradients), into buckets of about ``bucket_bytes``. During the last
micro-batch's backward, each parameter's post-accumulate-grad hook marks it ready; when a
bucket is complete its gradients are copied into the bucket's flat buffer and an
asynchronous SUM all-reduce starts, while backward carries on with earlier layers.

Buckets are launched strictly in index order, on every rank: collectives are matched by
their order, so a bucket that is ready early waits for its predecessors. ``finish()``
launches whatever backward did not (unused parameters count as zero gradients), waits,
and leaves the reduced gradients in ``param.grad``.

Where the bucket has the parameters' dtype, each ``param.grad`` *is* a view into the
bucket's buffer (as DDP's ``gradient_as_bucket_view``): autograd accumulates into it in
place, the all-reduce runs on it in place, and no gradient is copied. That is why
gradients are zeroed by ``zero_grad()`` here and never set to None. Buckets reduced in
fp32 for bf16 parameters copy in and out instead.

The caller scales each micro-batch's loss so that local gradients are the sum of the
per-sample gradients divided by the global batch; the SUM over ranks then gives the
global-batch gradient exactly (DESIGN invariant 2), with no division by the world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .collective import CollectiveGroup


@dataclass(slots=True)
class _Bucket:
    params: list[torch.nn.Parameter]
    views: list[torch.Tensor]
    """Per parameter, its slice of ``buffer`` shaped like the parameter."""
    buffer: torch.Tensor
    as_view: bool
    """The buffer has the parameters' dtype, so the views serve as their ``.grad``."""
    pending: int = 0
    ready: bool = False
    work: object | None = None
    seen: set[int] = field(default_factory=set)


class GradientReducer:
    """All-reduces gradients in buckets overlapped with backward."""

    def __init__(self, params: list[torch.nn.Parameter], group: CollectiveGroup, *,
                 bucket_bytes: int, reduce_fp32: bool) -> None:
        self.group = group
        self.buckets = _make_buckets([p for p in params if p.requires_grad], bucket_bytes, reduce_fp32)
        self._bucket_of: dict[int, int] = {}
        for b, bucket in enumerate(self.buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = b
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._armed = False
        self._next = 0

    def zero_grad(self) -> None:
        """Zero every gradient (the views stay attached as ``param.grad``)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
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
        for bucket in self.buckets:
            bucket.pending, bucket.ready, bucket.work = len(bucket.params), False, None
            bucket.seen.clear()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
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

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
        bucket.work = self.group.all_reduce_async(bucket.buffer)

    def finish(self) -> None:
        """Launch the buckets backward did not, wait for all; gradients are then global."""
        for bucket in self.buckets[self._next:]:
            bucket.ready = True
        self._launch_ready()
        self._armed = False
        for bucket in self.buckets:
            bucket.work.wait()
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                    continue
                if bucket.as_view:
                    p.grad = view
                elif p.grad is None:
                    p.grad = view.to(p.dtype)
                else:
                    p.grad.copy_(view)

    def disarm(self) -> None:
        """Forget a step that failed part-way; the next ``arm()`` starts clean."""
        self._armed = False


def _make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int, reduce_fp32: bool) -> list[_Bucket]:
    def buffer_dtype(p: torch.nn.Parameter) -> torch.dtype:
        if reduce_fp32 and p.dtype in (torch.bfloat16, torch.float16):
            return torch.float32
        return p.dtype

    buckets: list[_Bucket] = []
    current: list[torch.nn.Parameter] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if not current:
            return
        dtype = buffer_dtype(current[0])
        buffer = torch.zeros(sum(p.numel() for p in current), dtype=dtype, device=current[0].device)
        views, offset = [], 0
        for p in current:
            views.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        buckets.append(_Bucket(params=current, views=views, buffer=buffer, 
                               as_view=all(p.dtype == dtype for p in current)))
        current, size = [], 0

    for p in reversed(params):
        if current and (buffer_dtype(p) != buffer_dtype(current[0]) or p.device != current[0].device):
            close()
        current.append(p)
        size += p.numel() * torch.empty((), dtype=buffer_dtype(p)).element_size()
        if size >= bucket_bytes:
            close()
    close()
    return buckets
