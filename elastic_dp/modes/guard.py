"""What a run does with a step whose loss or gradient was not finite, in every mode.

The update was not applied, all alike: in the synchronous mode every rank skipped it (the
commit vote carries the flag), in the asynchronous mode the parameter servers passed the
version with no change. The step counts as trained, as a no-op. The guard records it and
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
        """The synchronous mode: whether committed step ``step`` (its members' ``results``)
        was skipped; raise when the run must end."""
        if not any(r.nonfinite for r in results):
            self.consecutive = 0
            return False
        ranks = sorted(r.rank for r in results if not r.loss_finite)
        what = (f"the loss was not finite on rank {', '.join(map(str, ranks))}" if ranks
                else "a gradient was not finite (every rank's loss was)")
        self._skipped(step, step, f"step {step}: {what}, and no update was applied", "steps", loss_ranks=ranks)
        return True

    def check_update(self, version: int, step: int, worker: str, finite: bool, loss_finite: bool) -> bool:
        """The asynchronous mode: whether update ``version`` (the gradient of sampler step
        ``step`` by ``worker``) was skipped; raise when the run must end."""
        if finite:
            self.consecutive = 0
            return False
        what = "the loss was not finite" if not loss_finite else "a gradient was not finite (the loss was)"
        # at the update's step in metrics.jsonl (version - 1)
        self._skipped(version - 1, version, f"update {version} (the gradient of sampler step {step} by {worker}): "
                      f"{what}, and it was not applied", "updates", update=version, sampler_step=step,
                      worker=worker, loss_ranks=[])
        return True

    def _skipped(self, step: int, number: int, what: str, unit: str, **fields) -> None:
        """``number``: of the step or update, counted in a row."""
        self.consecutive += 1
        self.recorder.event("nonfinite_step", step=step, consecutive=self.consecutive,
                            action="fail" if self.policy == "fail" else "skipped", **fields)
        if self.policy == "fail":
            raise NonFiniteError(f"{what} (--on-nonfinite fail): fix the data or the model, or pass "
                                 "--on-nonfinite skip to skip such steps")
        if self.consecutive >= self.max_consecutive:
            first = number - self.consecutive + 1
            raise NonFiniteError(f"{self.consecutive} consecutive {unit} ({first}..{number}) had a non-finite loss "
                                 f"or gradient and were skipped ({what}); --max-nonfinite-steps is {self.max_consecutive}: fix "
                                 "the data or the model, or raise it")
