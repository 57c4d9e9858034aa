"""What a run does with a step whose loss or gradient was not finite.

The workers already skipped its update, all alike (the commit vote carries the flag), so
the step committed as a no-op and its samples count as trained. The guard records it and
decides, from ``--on-nonfinite`` and ``--max-nonfinite-steps``, whether the run goes on.
"""

from __future__ import annotations

from elastic_dp.errors import NonFiniteError
from elastic_dp.messages import StepResult
from elastic_dp.observe.metrics import RunRecorder


class NonFiniteGuard:
    """Counts consecutive skipped steps; raises ``NonFiniteError`` when the run must end."""

    def __init__(self, policy: str, max_consecutive: int, recorder: RunRecorder) -> None:
        self.policy, self.max_consecutive, self.recorder = policy, max_consecutive, recorder
        self.consecutive = 0

    def check(self, step: int, results: list[StepResult]) -> bool:
        """Whether committed step ``step`` was skipped; raise when the run must end."""
        if not any(r.nonfinite for r in results):
            self.consecutive = 0
            return False
        self.consecutive += 1
        ranks = sorted(r.rank for r in results if not r.loss_finite)
        what = (f"the loss was not finite on rank {', '.join(map(str, ranks))}" if ranks
                else "a gradient was not finite (every rank's loss was)")
        self.recorder.event("nonfinite_step", step=step, loss_ranks=ranks, consecutive=self.consecutive,
                            action="fail" if self.policy == "fail" else "skipped")
        if self.policy == "fail":
            raise NonFiniteError(f"step {step}: {what}, and no update was applied (--on-nonfinite fail): fix "
                                 "the data or the model, or pass --on-nonfinite skip to skip such steps")
        if self.consecutive >= self.max_consecutive:
            first = step - self.consecutive + 1
            raise NonFiniteError(f"{self.consecutive} consecutive steps ({first}..{step}) had a non-finite loss or "
                                 f"gradient and were skipped (step {step}: {what}); --max-nonfinite-steps is "
                                 f"{self.max_consecutive}: fix the data or the model, or raise it")
        return True
