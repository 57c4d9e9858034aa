"""Fault injection: ``--inject SPEC`` (repeatable), for users validating a setup and for tests.

    kill:step=S:rank=R[:phase=P]   the worker process of rank R dies (SIGKILL) during step S;
                                    P is forward (default), allreduce, optimizer, snapshot
                                    (ZeRO's peer snapshot) or checkpoint
    hang:step=S:rank=R[:phase=P]   the worker stops (SIGSTOP) and never answers again
    join:step=S                    one more worker joins before step S

The coordinator owns the plan and hands each fault to its worker once, with the step it
dispatches; a step re-run after the fault does not fault again.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from .errors import ConfigError

PHASES = ("forward", "allreduce", "optimizer", "snapshot", "checkpoint")
KINDS = ("kill", "hang", "join")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    phase: str = "forward"

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        kind, *fields = spec.split(":")
        usage = ("--inject takes kill:step=S:rank=R[:phase=forward|allreduce|optimizer|snapshot|checkpoint], "
                 f"hang:step=S:rank=R or join:step=S; got {spec!r}")
        if kind not in KINDS:
            raise ConfigError(usage)
        values: dict[str, str] = {}
        for f in fields:
            key, sep, value = f.partition("=")
            if not sep or key not in ("step", "rank", "phase") or key in values:
                raise ConfigError(usage)
            values[key] = value
        try:
            step = int(values["step"])
            rank = int(values["rank"]) if "rank" in values else None
        except (KeyError, ValueError):
            raise ConfigError(usage) from None
        phase = values.get("phase", "forward")
        if step < 0 or (rank is not None and rank < 0) or phase not in PHASES:
            raise ConfigError(usage)
        if (kind == "join") != (rank is None) or (kind == "join" and "phase" in values):
            raise ConfigError(usage)
        return cls(kind=kind, step=step, rank=rank, phase=phase)


def trigger(fault: Fault | None, phase: str) -> None:
    """In a worker: carry out ``fault`` if it is due in ``phase``."""
    if fault is None or fault.phase != phase:
        return
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)


class FaultPlan:
    """The faults still to inject; each is handed out once."""

    def __init__(self, faults: list[Fault]) -> None:
        self._pending = list(faults)

    def take(self, step: int, rank: int, phases: tuple[str, ...]) -> Fault | None:
        for fault in self._pending:
            if fault.kind != "join" and fault.step == step and fault.rank == rank and fault.phase in phases:
                self._pending.remove(fault)
                return fault
        return None

    def joins_due(self, step: int) -> int:
        due = [f for f in self._pending if f.kind == "join" and f.step <= step]
        for f in due:
            self._pending.remove(f)
        return len(due)
