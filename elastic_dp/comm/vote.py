"""The commit vote: what each rank says of a step, and the tally every rank receives.

A step commits only when every rank's collectives completed and no rank recorded an error
(record, gate, commit; docs/design.md, atomic steps). Each rank fills in its ``Ballot``
during the step, on the step's device and without a synchronisation; some collective of
the step carries it, and the SUM over the ranks is the ``Vote`` every rank acts on alike.
The synchronous mode's gradient reduction carries it in the last bucket where the bucket's
reduction is a plain SUM (``elastic_dp.comm.reducer``, ``elastic_dp.comm.reductions``), so
no collective is spent on it; under a reduction that is not (a compressor) it goes on a
channel of its own beside the last bucket (``Ballot.send``), and a step that makes no
gradient reduction casts it on its own (``Ballot.cast``).

A ballot also says which of the reduced parameters this rank's step gave a gradient
(``Ballot.used``: one element each after the three counts, a SUM like them), so that every
rank knows the parameters no rank used, which get no update as plain PyTorch leaves a
``None`` gradient (docs/sync.md, parameters without a gradient).

A ballot may carry a payload: a float64 tensor summed over the ranks with it (launched
right after the vote's own collective and waited for with it), so that what the ranks must
agree on after a committed step (the model's buffers, ``elastic_dp.state.buffers``) is
known together with the tally, or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from elastic_dp.comm.group import CollectiveGroup


@dataclass(frozen=True, slots=True)
class Vote:
    """A step's tally over every rank."""

    errors: int = 0
    """Ranks whose step raised: the step commits on no rank, and is re-run or fails."""
    nonfinite: int = 0
    """Ranks that saw a non-finite loss or local gradient: the step commits as a no-op
    (every rank skips the update)."""
    stops: int = 0
    """Ranks asked to end their window after this step: every rank ends it here."""
    payload: torch.Tensor | None = field(default=None, compare=False)
    """The ballots' payloads summed over the ranks (None: the ballots carried none)."""
    uses: tuple[int, ...] = field(default=(), compare=False)
    """Per parameter of the ballots' (``Ballot.used``), how many ranks gave it a gradient;
    empty: the ballots said nothing of it (every parameter counts as used)."""

    @property
    def commits(self) -> bool:
        return self.errors == 0

    @property
    def updates(self) -> bool:
        """The step commits and its update is applied."""
        return self.errors == 0 and self.nonfinite == 0

    @property
    def stop(self) -> bool:
        return self.stops > 0

    def unused(self, index: int) -> bool:
        """No rank gave parameter ``index`` (of ``Ballot.used``'s) a gradient."""
        return bool(self.uses) and self.uses[index] == 0

    @classmethod
    def of(cls, summed: torch.Tensor, payload: torch.Tensor | None = None) -> "Vote":
        """The tally from a summed ballot tensor (``Ballot.COUNTS`` counts, then the uses)."""
        errors, nonfinite, stops, *uses = (int(round(v)) for v in summed.float().tolist())
        return cls(errors=errors, nonfinite=nonfinite, stops=stops, payload=payload, uses=tuple(uses))


class Ballot:
    """This rank's vote on the step, a tensor of ``size`` elements on the step's device:
    [error, non-finite, stop] (``COUNTS``), in the order ``Vote`` reads them back, then one
    element per parameter of ``params`` (1: this rank's step gave it a gradient)."""

    COUNTS = 3

    def __init__(self, device: torch.device | str = "cpu", params: int = 0) -> None:
        self.size = self.COUNTS + params
        self.tensor = torch.zeros(self.size, dtype=torch.float32, device=device)
        self.payload: torch.Tensor | None = None
        """A float64 tensor (the same length on every rank) summed over the ranks with the
        vote; set before the ballot leaves, cleared with it."""

    def clear(self) -> None:
        self.tensor.zero_()
        self.payload = None

    def error(self) -> None:
        """This rank's step raised: it votes against the commit."""
        self.tensor[0] = 1.0

    def nonfinite(self, count: torch.Tensor | float = 1.0) -> None:
        """A loss or gradient of this rank is not finite (``count``: how many, or a 0-dim
        tensor computed on the device, so that nothing waits for it)."""
        self.tensor[1] += count

    def stop(self) -> None:
        """This rank was asked to end its window after this step."""
        self.tensor[2] = 1.0

    def used(self, flags: list[int]) -> None:
        """Which parameters this rank's step gave a gradient (one flag each, 0 or 1)."""
        if flags:
            self.tensor[self.COUNTS:] = torch.tensor(flags, dtype=torch.float32)

    def alone(self) -> Vote:
        """The tally of a step with no other rank, or no collective to carry the ballot."""
        return Vote.of(self.tensor, self.payload)

    def send_payload(self, group: CollectiveGroup) -> tuple[object, torch.Tensor] | None:
        """Start summing a copy of the payload over ``group``: (the handle, the sum once
        waited for); None when there is no payload."""
        if self.payload is None:
            return None
        summed = self.payload.clone()
        return group.all_reduce_async(summed), summed

    def send(self, group: CollectiveGroup) -> tuple[object, torch.Tensor]:
        """Start summing a copy of the ballot over ``group`` in a collective of its own (the
        vote's own channel, where no reduction's SUM carries it): (the handle, the sum once
        waited for)."""
        summed = self.tensor.clone()
        return group.all_reduce_async(summed), summed

    def cast(self, group: CollectiveGroup) -> Vote:
        """Sum the ballots of ``group`` (and their payloads) in collectives of their own."""
        summed = self.tensor.clone()
        work, sent = group.all_reduce_async(summed), self.send_payload(group)
        work.wait()
        if sent is not None:
            sent[0].wait()
        return Vote.of(summed, None if sent is None else sent[1])
