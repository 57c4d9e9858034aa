"""Reductions: how a flat tensor of gradients crosses the ranks, as a plug-in.

The bucketed reducer (``elastic_dp.comm.reducer``) owns the buckets, the backward hooks
and the order of launches; what each bucket's collective is, it asks of its
``Reduction`` (the shape of DDP's communication hooks: a bucket in, a handle out). A mode
that reduces a tensor of its own goes through the same interface (DiLoCo's pseudo-gradient,
``modes.diloco.program``). Two are built in:

- ``AllReduce``: every rank receives the SUM of the tensor (ZeRO stage 0, DiLoCo's outer
  step); with ``wire_dtype`` the tensor crosses in that dtype (DiLoCo's ``--outer-reduce
  bf16``: half the bytes, the sum rounded) and the result is copied back into it.
- ``ReduceScatter``: each rank receives its chunk of the SUM (ZeRO stages 1 to 3).

A reduction says whether its result is the plain SUM of what every rank sent (``sums``):
then the commit vote rides the tail of the last bucket's collective, costing no collective
of its own; a reduction whose result is not a plain sum (a compressor) has the vote cast on
a channel of its own (``elastic_dp.comm.vote.Ballot.send``).

A reduction may keep state between steps (a compressor's error feedback): it declares it
as ``ModelBuffers`` declares the model's buffers (``state``, ``load_state``). The step saves
it before the vote and restores it when the step does not commit (``save``, ``restore``);
each new generation re-cuts it (``resize``); each rank's checkpoint part holds its own as a
row of ``reduction/<key>`` (one row a rank), which a resumed run hands back to it whole
(``load_rows``: at the saved world size each rank takes its own row). The built-in ones
keep none.
"""

from __future__ import annotations

import datetime
from typing import Any, ClassVar

import torch

from elastic_dp.comm.group import CollectiveGroup


class Reduction:
    """One bucket's collective over the ranks (a subclass per way of reducing)."""

    name: ClassVar[str]
    sums: ClassVar[bool] = True
    """The result is the plain SUM of what every rank sent, so a tensor appended to the
    bucket (the commit vote) is summed with it."""

    def __init__(self, group: CollectiveGroup) -> None:
        self.group = group
        self._generation: int | None = None  # the generation the state is cut for

    def follow(self) -> None:
        """Before a step: where the group is of another generation than the state was cut
        for, re-cut it (``resize``). A reduction lives as long as its strategy, across
        generations, and is told of each one here."""
        if self._generation != self.group.generation:
            self._generation = self.group.generation
            self.resize(self.group.world_size)

    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        """Start reducing bucket ``index``'s flat ``tensor`` (``out``: where this rank's
        chunk of the result goes, for a scattering reduction); a handle with ``wait()``."""
        raise NotImplementedError

    def wire_bytes(self, tensor: torch.Tensor) -> int:
        """The bytes of ``tensor`` as this reduction sends them (before the collective's own
        algorithm multiplies them)."""
        return tensor.numel() * tensor.element_size()

    # -- state between steps (none for the built-in ones) ---------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """This rank's state, by name (saved in its checkpoint part)."""
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take ``state`` (as ``state`` returned it; empty: start fresh)."""

    def save(self) -> None:
        """Before a step: keep the state to go back to if the step does not commit."""

    def restore(self) -> None:
        """The step did not commit: back to the state ``save`` kept."""

    def resize(self, world_size: int) -> None:
        """A new generation of ``world_size`` ranks: re-cut the state for it."""

    def load_rows(self, rows: dict[str, torch.Tensor], rank: int, world_size: int) -> None:
        """From a checkpoint: ``rows[key]`` holds every saved rank's ``state()[key]``, one
        row a rank (none: the checkpoint has no state of a reduction). At the saved world
        size rank ``rank`` takes its own row; at another the state starts fresh (a reduction
        whose state must outlive a change of world size re-cuts the rows here instead)."""
        if rows and all(v.shape[0] == world_size for v in rows.values()):
            self.load_state({k: v[rank].clone() for k, v in rows.items()})
        else:
            self.load_state({})


class _CopiedBack:
    """A collective on a copy of a tensor in another dtype: ``wait()`` copies the result back."""

    def __init__(self, work: Any, sent: torch.Tensor, into: torch.Tensor) -> None:
        self.work, self.sent, self.into = work, sent, into

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.work is not None:
            self.work.wait() if timeout is None else self.work.wait(timeout)
            self.into.copy_(self.sent)
            self.work = self.sent = None
        return True


class AllReduce(Reduction):
    """Every rank receives the SUM, in place (``wire_dtype``: sent in that dtype, the sum
    rounded to it, then copied back)."""

    name = "allreduce"

    def __init__(self, group: CollectiveGroup, wire_dtype: torch.dtype | None = None) -> None:
        super().__init__(group)
        self.wire_dtype = wire_dtype

    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        if out is not None:
            raise ValueError("an all-reduce leaves its result in place: it takes no out")
        if self.wire_dtype is None or tensor.dtype == self.wire_dtype:
            return self.group.all_reduce_async(tensor)
        sent = tensor.to(self.wire_dtype)
        return _CopiedBack(self.group.all_reduce_async(sent), sent, tensor)

    def wire_bytes(self, tensor: torch.Tensor) -> int:
        dtype = self.wire_dtype or tensor.dtype
        return tensor.numel() * torch.empty((), dtype=dtype).element_size()


class ReduceScatter(Reduction):
    """Each rank receives its chunk of the SUM into ``out`` (which may be its own chunk of
    the tensor: in place)."""

    name = "reducescatter"

    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        if out is None:
            raise ValueError("a reduce-scatter needs out, this rank's chunk")
        return self.group.reduce_scatter_async(out, tensor)
