"""``--balance``: slices of each step's global batch that follow the workers' measured speed.

The global batch is fixed and each micro-batch's loss is scaled by its share of that
batch, so the gradient summed over the ranks is the same however the batch is split
(docs/design.md, fixed global batch): a slow worker can be given fewer samples, and the run still ends on
the plain replay's parameters. Each worker's compute time per sample (forward and
backward, from its step reports) is smoothed; the slices are proportional to the speeds,
at least one sample each, and change only when some slice would move by more than
``MIN_CHANGE`` of its size. A new slicing takes effect from the first step of a grant,
which every rank receives alike (``modes.sync.grants.Grants``); until every member has been measured
the slices are equal.
"""

from __future__ import annotations

from typing import Any

from elastic_dp.messages import StepResult

SMOOTHING = 0.3
"""Weight of the newest step in each worker's smoothed time per sample."""
MIN_CHANGE = 0.05
"""A new slicing is used only if some slice changes by more than this fraction of its size
(and by at least one sample): measurement noise does not re-slice every grant."""


def apportion(total: int, weights: list[float]) -> tuple[int, ...]:
    """``total`` split in proportion to ``weights``, at least 1 each (largest remainders)."""
    if total < len(weights):
        raise ValueError(f"cannot give each of {len(weights)} ranks a sample of {total}")
    spare = total - len(weights)
    shares = [spare * w / sum(weights) for w in weights]
    sizes = [1 + int(s) for s in shares]
    order = sorted(range(len(weights)), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in order[:total - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes)


class Balancer:
    """Smoothed time per sample of each member, and the slicing that follows it."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch
        self.per_sample: dict[Any, float] = {}

    def observe(self, results: dict[Any, StepResult]) -> None:
        for member, result in results.items():
            compute = result.timings.get("compute_s")
            if compute and result.samples:
                seconds = compute / result.samples
                old = self.per_sample.get(member)
                self.per_sample[member] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def sizes(self, members: list[Any], current: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The slicing for ``members`` in rank order: ``current`` unless it should change."""
        if len(members) < 2 or any(m not in self.per_sample for m in members):
            return current
        new = apportion(self.global_batch, [1 / self.per_sample[m] for m in members])
        base, extra = divmod(self.global_batch, len(members))
        now = current if current is not None and len(current) == len(members) else \
            tuple(base + (r < extra) for r in range(len(members)))  # the equal slices
        if all(abs(a - b) <= max(1, MIN_CHANGE * b) for a, b in zip(new, now)):
            return current
        return new
