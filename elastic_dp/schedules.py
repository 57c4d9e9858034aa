"""Learning-rate schedules. The rate of a step is a pure function of the step, so that it
does not depend on who trains the step, how often it was attempted, or where the run
resumed: elastic invariance holds and a plain replay applies the same rates (the rules:
README, "The replay contract").

Three sources, one of them per run:
- ``TrainConfig.lr_schedule`` (``--lr-schedule``): warmup, then constant, cosine, linear
  or warmup-stable-decay (``schedule_factor``);
- ``Task.lr_schedule``: the user's own ``step -> factor``;
- ``Task.scheduler``: a torch ``LRScheduler`` over the optimizer (``SchedulerRates``).

Each is multiplied by the linear-scaling factor (``--lr-reference-batch``).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

from elastic_dp.errors import ConfigError, TaskError

SCHEDULES = ("constant", "cosine", "linear", "wsd")


def decay_start(warmup: int, decay_steps: int, decay_fraction: float) -> int:
    """``wsd``: the first step of the decay, the last ``decay_fraction`` of the
    ``decay_steps`` steps (not before the warmup ends)."""
    return max(warmup, decay_steps - round(decay_fraction * decay_steps))


def schedule_factor(schedule: str, step: int, *, warmup: int, decay_steps: int, min_ratio: float,
                    decay_fraction: float) -> float:
    """The factor on each base learning rate at ``step`` (0-based), before linear scaling:
    ``(step + 1) / warmup`` during the warmup; then 1 (``constant``); a cosine or a line
    from 1 down to ``min_ratio`` at ``decay_steps`` (``cosine``, ``linear``); or 1 until
    ``decay_start`` and a line down to ``min_ratio`` at ``decay_steps`` (``wsd``);
    ``min_ratio`` from ``decay_steps`` on."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if step >= decay_steps:
        return min_ratio
    start = decay_start(warmup, decay_steps, decay_fraction) if schedule == "wsd" else warmup
    if step < start:
        return 1.0
    progress = (step - start) / (decay_steps - start)
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * (1 - progress)


def checked_factor(rule: Callable[[int], float], step: int) -> float:
    """``Task.lr_schedule(step)``, refused unless it is a finite number >= 0."""
    factor = rule(step)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
        raise TaskError(f"Task.lr_schedule({step}) returned {factor!r}: it must return a finite number >= 0, "
                        "the factor on the optimizer's base learning rates at that step")
    return float(factor)


class SchedulerRates:
    """The learning rate a torch ``LRScheduler`` gives each param group at each step.

    The scheduler the task builds is stepped over a stand-in: an optimizer of the same
    class with the same param groups, one element each and no gradients. The rate of step
    ``s`` is the stand-in's after ``s`` scheduler steps, so that the real optimizer's rate
    is a function of the step: a re-run step, a rollback or a joiner reads the same rate,
    and no step steps the scheduler twice. ``state(s)`` is the scheduler's state dict
    after ``s`` steps (what checkpoints and joiners carry); ``load(state, s)`` goes on
    from one, as a resumed or joining worker does.
    """

    def __init__(self, factory: Callable[[Any], Any], optimizer: Any) -> None:
        self._factory = factory
        self._groups = [{k: v for k, v in g.items() if k not in ("params", "initial_lr")}
                        for g in optimizer.param_groups]
        self._class = type(optimizer)
        self.load(None, 0)

    def load(self, state: dict | None, step: int) -> None:
        """Start over from the scheduler's ``state`` after ``step`` steps (None: a new
        scheduler, at step 0)."""
        import torch  # here: the configuration imports this module, and the control plane runs without torch

        groups = [dict(g, params=[torch.zeros(1, requires_grad=True)]) for g in self._groups]
        try:
            self._optimizer = self._class(groups)
        except Exception:  # an optimizer whose constructor wants more than its param groups
            self._optimizer = torch.optim.SGD(groups, lr=self._groups[0]["lr"])
        scheduler = self._factory(self._optimizer)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise TaskError(f"Task.scheduler returned {type(scheduler).__name__}, expected a "
                            "torch.optim.lr_scheduler.LRScheduler over the optimizer it is given")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TaskError("Task.scheduler returned ReduceLROnPlateau, which steps on a metric: the rate of a "
                            "step must follow from the step alone (use Task.lr_schedule, or a step-based scheduler)")
        if state is not None:
            scheduler.load_state_dict(state)
            for group, lr in zip(self._optimizer.param_groups, state.get("_last_lr", ())):
                group["lr"] = lr  # the optimizer's side of the state, which chained schedulers read
        self._scheduler, self._start, self._origin = scheduler, step, state
        self._rates: list[list[float]] = []
        self._record()

    def _record(self) -> None:
        step = self._start + len(self._rates)
        for i, (group, before) in enumerate(zip(self._optimizer.param_groups, self._groups)):
            changed = [k for k, v in before.items() if k != "lr" and not _same(group.get(k), v)]
            if changed:
                raise TaskError(f"Task.scheduler changed {changed[0]!r} of param group {i} at step {step}: "
                                "elastic_dp schedules the learning rate only (turn that off, e.g. "
                                "OneCycleLR(cycle_momentum=False))")
        self._rates.append([float(g["lr"]) for g in self._optimizer.param_groups])

    def at(self, step: int) -> list[float]:
        """Each param group's learning rate at ``step``, before linear scaling."""
        if step < self._start:  # before the state it went on from: from a new scheduler
            self.load(None, 0)
        while self._start + len(self._rates) <= step:
            self._optimizer.step()  # no gradients: changes nothing, but a scheduler expects it first
            self._scheduler.step()
            self._record()
        return self._rates[step - self._start]

    def state(self, step: int) -> dict:
        """The scheduler's state dict after ``step`` steps."""
        if step < self._start + len(self._rates) - 1:  # behind this one: over again, from its origin
            self.load(*((self._origin, self._start) if step >= self._start else (None, 0)))
        self.at(step)
        return copy.deepcopy(self._scheduler.state_dict())


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except RuntimeError:  # tensors of more than one element
        return a is b or (hasattr(a, "equal") and a.equal(b))


class LearningRates:
    """A run's learning rates: each param group's at each step, from the one source the
    task and the configuration chose, times the linear-scaling factor."""

    def __init__(self, task: Any, config: Any, optimizer: Any) -> None:
        self.base = [g["lr"] for g in optimizer.param_groups]
        self.scaling = config.lr_scaling()
        self.scheduler = SchedulerRates(task.scheduler, optimizer) if task.scheduler is not None else None
        self._factor = factor_rule(task, config)

    def at(self, step: int) -> list[float]:
        if self.scheduler is not None:
            return [lr * self.scaling for lr in self.scheduler.at(step)]
        factor = self._factor(step)
        return [base * factor for base in self.base]


def factor_rule(task: Any, config: Any) -> Callable[[int], float]:
    """``step -> factor`` on the base rates, linear scaling included: ``Task.lr_schedule``
    if the task has one, else the configuration's schedule (``TrainConfig.lr_factor``)."""
    if task is None or task.lr_schedule is None:
        return config.lr_factor
    rule, scaling = task.lr_schedule, config.lr_scaling()
    return lambda step: scaling * checked_factor(rule, step)


def check_sources(task: Any, config: Any) -> None:
    """One source of rates per run: refuse a task with both ``lr_schedule`` and
    ``scheduler``, or either with a configured schedule or warmup, which it would override."""
    if task.lr_schedule is not None and task.scheduler is not None:
        raise ConfigError("the task has both Task.lr_schedule and Task.scheduler: keep one of them")
    own = "Task.lr_schedule" if task.lr_schedule is not None else "Task.scheduler" if task.scheduler else None
    if own is None:
        return
    if config.lr_schedule != "constant" or config.warmup_steps:
        raise ConfigError(f"{own} sets the learning rate of every step, and this run also asks for "
                          f"--lr-schedule {config.lr_schedule} --warmup-steps {config.warmup_steps}: drop those "
                          f"(or {own}, to use them)")
    if own == "Task.scheduler" and not config.mode.steps_task_optimizer:
        raise ConfigError(f"Task.scheduler is a torch LRScheduler over each worker's optimizer, and --mode "
                          f"{config.mode.name} steps the optimizer elsewhere: give the task a Task.lr_schedule "
                          "(step -> factor) instead, or use --mode sync")
