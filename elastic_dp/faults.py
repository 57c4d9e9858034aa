"""Fault injection: ``--inject SPEC`` (repeatable), for users validating a setup and for tests.

    kill:step=S:rank=R[:phase=P]   the worker process of rank R dies (SIGKILL) during step S;
                                    P is forward (default), gather_forward and gather_backward
                                    (--zero 3: as it all-gathers a unit's parameters in the
                                    forward, in the backward), allreduce, optimizer, snapshot
                                    (ZeRO's peer snapshot), checkpoint (while rank R copies
                                    its part of the checkpoint after step S), upload (while
                                    it writes that part in the background), eval (while rank R
                                    evaluates after step S, --eval-every), reform (rank R of the
                                    generation formed after another fault at step S, as it joins)
                                    or shard (--mode async: parameter-server shard R, as it
                                    applies update S, the one that makes version S + 1)
    hang:step=S:rank=R[:phase=P]   the worker stops (SIGSTOP) and never answers again
    join:step=S                    one more worker joins before step S
    slow:rank=R:factor=F[:from=S][:to=S2]
                                   rank R computes F times slower in steps S..S2-1 (default:
                                   from 0, to the end): after its forward and backward it
                                   sleeps F-1 times as long as they took (a straggler)
    slowlink:ms=M                  a slow link: every all-reduce, reduce-scatter and
                                   all-gather of the workers' groups ends M ms after it
                                   started at the earliest (a latency; not --mode async)

``parse_faults`` refuses, with the reason, a fault that can never fire in the configured
run. The modes hand each fault to its worker once; a fault whose worker came back without
firing it (the step failed before its phase) is handed out again on the re-run, and one
that never fired is reported at the end of the run with the reason (``FaultPlan.unfired``).
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from elastic_dp.config import CheckpointConfig, ClusterConfig, TrainConfig
from elastic_dp.errors import ConfigError

STEP_PHASES = ("forward", "gather_forward", "gather_backward", "allreduce", "optimizer", "snapshot")
SAVE_PHASES = ("checkpoint", "upload")
PHASES = (*STEP_PHASES, *SAVE_PHASES, "eval", "reform", "shard")
_CALL_OF = {"checkpoint": "checkpoint", "upload": "checkpoint", "reform": "reform", "eval": "eval"}
"""The call a fault of a phase outside the step fires in (``FaultPlan._why``)."""
KINDS = ("kill", "hang", "join", "slow", "slowlink")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    step: int
    """The step it fires in; for ``slow``, the first step it slows."""
    rank: int | None = None
    phase: str = "forward"
    factor: float = 1.0
    """``slow``: how many times longer the rank's compute takes; ``slowlink``: the ms."""
    until: int | None = None
    """``slow``: the first step it no longer slows (None: to the end)."""

    def __str__(self) -> str:
        if self.kind == "join":
            return f"join:step={self.step}"
        if self.kind == "slowlink":
            return f"slowlink:ms={self.factor:g}"
        if self.kind == "slow":
            return (f"slow:rank={self.rank}:factor={self.factor:g}:from={self.step}"
                    + (f":to={self.until}" if self.until is not None else ""))
        return f"{self.kind}:step={self.step}:rank={self.rank}:phase={self.phase}"

    def slows(self, step: int) -> bool:
        """A ``slow`` fault that applies to ``step``."""
        return self.kind == "slow" and self.step <= step and (self.until is None or step < self.until)

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        kind, *fields = spec.split(":")
        usage = (f"--inject takes kill:step=S:rank=R[:phase={'|'.join(PHASES)}], "
                 f"hang:step=S:rank=R, join:step=S, slow:rank=R:factor=F[:from=S][:to=S2] or slowlink:ms=M; "
                 f"got {spec!r}")
        if kind not in KINDS:
            raise ConfigError(usage)
        values: dict[str, str] = {}
        keys = {"slow": ("rank", "factor", "from", "to"), "slowlink": ("ms",)}.get(kind, ("step", "rank", "phase"))
        for f in fields:
            key, sep, value = f.partition("=")
            if not sep or key not in keys or key in values:
                raise ConfigError(usage)
            values[key] = value
        if kind == "slow":
            return cls._parse_slow(values, usage)
        if kind == "slowlink":
            try:
                ms = float(values["ms"])
            except (KeyError, ValueError):
                raise ConfigError(usage) from None
            if not ms > 0:
                raise ConfigError(f"{usage} (ms > 0)")
            return cls(kind="slowlink", step=0, factor=ms)
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

    @classmethod
    def _parse_slow(cls, values: dict[str, str], usage: str) -> "Fault":
        try:
            rank, factor = int(values["rank"]), float(values["factor"])
            start = int(values.get("from", 0))
            until = int(values["to"]) if "to" in values else None
        except (KeyError, ValueError):
            raise ConfigError(usage) from None
        if rank < 0 or start < 0 or not factor >= 1 or (until is not None and until <= start):
            raise ConfigError(f"{usage} (rank >= 0, factor >= 1, 0 <= from < to)")
        return cls(kind="slow", step=start, rank=rank, phase="forward", factor=factor, until=until)


def parse_faults(specs: Iterable[str | Fault], train: TrainConfig, cluster: ClusterConfig,
                 checkpoint: CheckpointConfig) -> list[Fault]:
    """Parse ``--inject`` specs and refuse each fault that can never fire in this run."""
    faults = [f if isinstance(f, Fault) else Fault.parse(f) for f in specs]
    for f in faults:
        _check(f, faults, train, cluster, checkpoint)
    if sum(f.kind == "slowlink" for f in faults) > 1:
        raise ConfigError("--inject slowlink: one spec (the link's latency)")
    slow = [f.rank for f in faults if f.kind == "slow"]
    if len(slow) != len(set(slow)):
        raise ConfigError("--inject slow: one spec per rank (give a rank one factor, from and to)")
    joins = sum(f.kind == "join" for f in faults)
    room = cluster.workers - cluster.min_workers
    if joins > room:
        raise ConfigError(f"--inject join:step=S needs a worker held back for it: {joins} joins, but --workers "
                          f"{cluster.min_workers}:{cluster.workers} leaves room for {room} (each join holds one "
                          "of MAX-MIN workers back until its step): raise MAX or lower MIN")
    return faults


def _check(f: Fault, faults: list[Fault], train: TrainConfig, cluster: ClusterConfig,
           checkpoint: CheckpointConfig) -> None:
    def refuse(why: str) -> None:
        raise ConfigError(f"--inject {f} can never fire: {why}")

    why = train.mode.unreachable(f, train)  # what the mode cannot fire
    if why:
        refuse(why)
    if f.kind == "slowlink":
        return
    if f.step >= train.steps:
        refuse(f"the run trains steps 0..{train.steps - 1} (--steps {train.steps})")
    if f.phase == "shard":
        shards = getattr(train.mode, "ps_shards", 0)  # --mode async's; the other modes have none
        if f.rank >= shards:
            refuse(f"phase=shard kills parameter-server shard R of --mode async: the run has "
                   f"{shards or 'no'} shards (--ps-shards, --mode)")
    elif f.rank is not None and f.rank >= cluster.workers:
        refuse(f"the run has at most {cluster.workers} workers, ranks 0..{cluster.workers - 1} (--workers)")
    if f.phase in SAVE_PHASES:
        every = checkpoint.every
        if not checkpoint.enabled:
            refuse("no checkpoint is saved without --checkpoint-dir or --storage")
        if f.phase == "upload" and not checkpoint.asynchronous:
            refuse("phase=upload fires in a background save, and --sync-checkpoints saves on the training thread")
        if not ((every and (f.step + 1) % every == 0) or f.step + 1 == train.steps):
            refuse(f"no checkpoint is saved after step {f.step}: --checkpoint-every {every} saves after steps "
                   "whose number plus one it divides, and after the last step")
    if f.phase == "eval":
        every = train.eval_every
        if not every or not ((f.step + 1) % every == 0 or f.step + 1 == train.steps):
            refuse(f"no evaluation runs after step {f.step}: --eval-every {every} evaluates after steps whose "
                   "number plus one it divides, and after the last step")
    if f.phase in ("gather_forward", "gather_backward") and not train.stage.shards_parameters:
        refuse(f"phase={f.phase} fires as a unit's parameters are all-gathered, which only --zero 3 does")
    if f.phase == "snapshot" and (not train.stage.sharded or (f.step + 1) % train.stage.snapshot_every):
        every = train.stage.snapshot_every if train.stage.sharded else 1
        refuse(f"phase=snapshot needs --zero 1, 2 or 3 and a step after which a snapshot is taken: (step + 1) "
               f"divisible by --snapshot-every {every}")
    if f.phase == "reform" and not any(g.kind != "join" and g.step == f.step and g.phase in STEP_PHASES
                                       for g in faults):
        refuse(f"phase=reform fires while the group re-forms after another fault in step {f.step}: add a "
               f"kill or hang at step={f.step} in a step phase ({', '.join(STEP_PHASES)})")


class FaultHook:
    """The faults handed to this process, each carried out at its phase.

    The coordinator hands a worker (or a parameter-server shard) the faults of a call with
    the call; the actor arms them here (``arm``), and the code of each phase says where it
    is (``at("forward")``, ``at("snapshot")``, ...): an armed fault of that phase fires
    there, once. Nothing else of the production code knows of fault injection. A step's
    faults that did not fire are disarmed when the step ends (``disarm``), so none fires in
    a later one; a ``slow`` fault slows the steps it names (``straggle``).
    """

    def __init__(self) -> None:
        self._armed: dict[str, Fault] = {}
        self.slow: Fault | None = None
        """The straggler fault slowing the current step, if any."""

    def arm(self, *faults: Fault | None) -> None:
        for fault in faults:
            if fault is not None:
                self._armed[fault.phase] = fault

    def disarm(self, phases: Iterable[str] = STEP_PHASES) -> None:
        for phase in phases:
            self._armed.pop(phase, None)

    def at(self, phase: str) -> None:
        """This process has reached ``phase``: carry out the fault armed for it, if any."""
        fault = self._armed.pop(phase, None)
        if fault is None:
            return
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)

    def straggle(self, compute_s: float) -> bool:
        """``--inject slow``: make a step whose compute took ``compute_s`` take ``factor``
        times as long; whether it did."""
        if self.slow is None:
            return False
        time.sleep((self.slow.factor - 1) * compute_s)
        return True


class FaultPlan:
    """The faults still to inject, and what the run did with them."""

    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        faults = list(faults)
        self.slow = {f.rank: f for f in faults if f.kind == "slow"}
        """Stragglers, by rank: they apply for a range of steps and are never used up."""
        self.link_delay_s = max((f.factor / 1000 for f in faults if f.kind == "slowlink"), default=0.0)
        """``slowlink``: the least time each collective of the workers' groups takes."""
        self._pending = [f for f in faults if f.kind not in ("slow", "slowlink")]
        self._sizes: dict[tuple[str, int], set[int]] = defaultdict(set)  # (what, step) -> world sizes
        self._given: list[Fault] = []  # kills and hangs handed out, until a loss is explained by one

    def _give(self, fault: Fault) -> Fault:
        self._pending.remove(fault)
        if fault.kind in ("kill", "hang"):
            self._given.append(fault)
        return fault

    def take(self, step: int, rank: int, phases: tuple[str, ...]) -> Fault | None:
        """The first pending fault for ``rank`` at ``step`` in one of ``phases`` (handed out)."""
        for fault in self._pending:
            if fault.kind != "join" and fault.step == step and fault.rank == rank and fault.phase in phases:
                return self._give(fault)
        return None

    def explain(self, step: int, ranks: Iterable[int]) -> Fault | None:
        """The kill or hang handed out to one of ``ranks`` that a loss of them found at ``step``
        is: one of that step or the two before (a window goes on past a step whose optimizer
        phase killed a rank; a hang is found by a deadline); the latest such, which then
        explains no other loss."""
        ranks = set(ranks)
        found = [f for f in self._given if f.rank in ranks and step - 2 <= f.step <= step]
        if not found:
            return None
        fault = max(found, key=lambda f: f.step)
        self._given.remove(fault)
        return fault

    def take_due(self, step: int, rank: int) -> Fault | None:
        """``--mode async``: the first pending kill or hang of ``rank`` at ``step`` or an
        earlier step (a worker computes whole steps, and not every one of them)."""
        for fault in self._pending:
            if fault.kind in ("kill", "hang") and fault.step <= step and fault.rank == rank and fault.phase != "shard":
                return self._give(fault)
        return None

    def _take_all(self, what: str, step: int, world_size: int, phases: tuple[str, ...]) -> dict[int, Fault]:
        """The faults of ``world_size`` ranks at ``step`` in one of ``phases``: rank -> fault;
        the world size is remembered under ``what`` (why one did not fire: ``_why``)."""
        self._sizes[what, step].add(world_size)
        taken = {rank: self.take(step, rank, phases) for rank in range(world_size)}
        return {rank: f for rank, f in taken.items() if f is not None}

    def take_step(self, step: int, world_size: int, phases: tuple[str, ...]) -> dict[int, Fault]:
        """The faults of an attempt at ``step`` on ``world_size`` ranks: rank -> fault."""
        return self._take_all("step", step, world_size, phases)

    def forget_step(self, step: int, world_size: int) -> None:
        """Step ``step`` was handed out to ``world_size`` ranks (granted) but never ran."""
        self._sizes["step", step].discard(world_size)
        if not self._sizes["step", step]:
            del self._sizes["step", step]

    def take_checkpoint(self, step: int, world_size: int) -> dict[int, Fault]:
        """The faults of the ranks that save the checkpoint after ``step``."""
        return self._take_all("checkpoint", step, world_size, SAVE_PHASES)

    def take_eval(self, step: int, world_size: int) -> dict[int, Fault]:
        """The faults of the ranks that evaluate after ``step`` (``--eval-every``)."""
        return self._take_all("eval", step, world_size, ("eval",))

    def take_reform(self, step: int, world_size: int) -> dict[int, Fault]:
        """The faults of the generation that re-forms after a failure in ``step``."""
        return self._take_all("reform", step, world_size, ("reform",))

    def put_back(self, faults: Iterable[Fault | None]) -> None:
        """Faults handed out that did not fire (their worker came back): pending again."""
        for fault in faults:
            if fault is not None:
                self._pending.append(fault)
                if fault in self._given:
                    self._given.remove(fault)

    def next_join(self, step: int) -> int | None:
        """The step of the next injected join after ``step`` (None: none is pending)."""
        later = [f.step for f in self._pending if f.kind == "join" and f.step > step]
        return min(later) if later else None

    def joins_due(self, step: int) -> int:
        due = [f for f in self._pending if f.kind == "join" and f.step <= step]
        for f in due:
            self._pending.remove(f)
        return len(due)

    def unfired(self) -> list[tuple[Fault, str]]:
        """Each fault that never fired, with the reason."""
        return [(f, self._why(f)) for f in self._pending]

    def _why(self, f: Fault) -> str:
        if f.kind == "join":
            return f"the run never reached step {f.step}"
        what = _CALL_OF.get(f.phase, "step")
        sizes = sorted(self._sizes.get((what, f.step), ()))
        if not sizes:
            return {"checkpoint": f"no checkpoint was saved after step {f.step} in this run",
                    "reform": f"no group re-formed after a failure in step {f.step}",
                    "eval": f"no evaluation ran after step {f.step} in this run",
                    "step": f"step {f.step} was never run in this run"}[what]
        if f.rank >= max(sizes):
            where = "the generation re-formed after it" if what == "reform" else f"step {f.step}"
            return f"{where} had {' or '.join(map(str, sizes))} workers: there was no rank {f.rank}"
        return f"rank {f.rank} finished step {f.step} without reaching phase {f.phase}"
