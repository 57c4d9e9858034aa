"""Local SGD and DiLoCo, worker side: H inner steps alone, then one outer step together.

Issue 29's first part: the replica's program of one outer step, over the collective
group, tested on thread ranks against the replay contract (docs/diloco.md). The mode
around it (its driver half, its windows at outer boundaries, the re-run of a failed
window, joiners, checkpoints, records, ``--mode diloco`` and its flags) is not built yet.

The contract, for the members k = 0 .. N-1 of one outer step t, with slices of n_k of
the global batch B (``split``: contiguous, as in sync mode):

- Every member starts from the same θ_t. Inner step h = 0 .. H-1 trains on sampler step
  s = t·H + h, on the member's slice of it: the task's loss, the mean over its own
  samples; its own gradient clipped by ``clip_grad_norm``; the base rates times the
  schedule's factor of s; the task's optimizer, whose state stays with the member
  across outer steps.
- The pseudo-gradient Δ = θ_t − Σ_k (n_k / B)·θ_k (the sample-weighted mean: uneven
  slices count by their samples) is one SUM all-reduce of each member's (n_k / B)(θ_t − θ_k),
  in fp32.
- The outer optimizer, torch's SGD (``outer_lr``, ``outer_momentum``; Nesterov unless
  plain momentum is asked; a momentum of 0 is plain SGD), steps θ_t with Δ as its
  gradient; every member then restarts from θ_{t+1}, identical on every member, and so
  is the outer optimizer's state. Local SGD is ``outer_lr=1, outer_momentum=0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from elastic_dp.messages import StepResult
from elastic_dp.task import trainable
from elastic_dp.worker.replica import Replica


@dataclass(frozen=True, slots=True)
class OuterSettings:
    """The outer loop: ``sync_every`` inner steps (H) per outer step, the outer SGD."""

    sync_every: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_lr must be > 0 and outer_momentum in [0, 1), got {self.outer_lr}, "
                             f"{self.outer_momentum}")


class DiLoCoProgram:
    """One member's inner steps and its part of the outer step, over a ``Replica`` whose
    group is the outer step's members."""

    def __init__(self, replica: Replica, settings: OuterSettings) -> None:
        self.replica, self.settings = replica, settings
        self.params = [p for _, p in trainable(replica.model, replica.optimizer)]
        self.theta = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params]
        """θ_t, the outer parameters, fp32."""
        nesterov = settings.nesterov and settings.outer_momentum > 0
        self.outer = torch.optim.SGD(self.theta, lr=settings.outer_lr, momentum=settings.outer_momentum,
                                     nesterov=nesterov)

    def start(self) -> None:
        """θ_t from the model's parameters (equal on every member: after ``broadcast_state``)."""
        with torch.no_grad():
            for theta, p in zip(self.theta, self.params):
                theta.copy_(p)

    def inner_step(self, step: int, indices: np.ndarray) -> StepResult:
        """Sampler step ``step`` on this member's slice ``indices``, alone."""
        replica = self.replica
        result = StepResult(step=step, rank=replica.group.rank, generation=replica.group.generation, committed=False)
        replica.strategy.zero_grad()
        if len(indices):
            replica.forward_backward(replica.collate(indices), result, vote=False, per=len(indices))
            if replica.config.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.params, replica.config.clip_grad_norm)
            for group, lr in zip(replica.optimizer.param_groups, replica.rates.at(step)):
                group["lr"] = lr
            replica.optimizer.step()
        result.committed = True
        return result

    @torch.no_grad()
    def outer_step(self, samples: int, global_batch: int) -> dict[str, float]:
        """A collective of the members: this member trained ``samples`` of each of the outer
        step's ``global_batch``-sample steps. Δ all-reduced, θ stepped, every member
        restarted from it. Returns the bytes this member's all-reduce carried and ‖Δ‖."""
        share = samples / global_batch
        delta = torch.cat([(theta - p.detach().float()).reshape(-1) * share for theta, p in zip(self.theta, self.params)])
        self.replica.group.all_reduce(delta)
        offset = 0
        for theta in self.theta:
            theta.grad = delta[offset:offset + theta.numel()].view_as(theta)
            offset += theta.numel()
        self.outer.step()
        for theta, p in zip(self.theta, self.params):
            theta.grad = None
            p.copy_(theta)
        return {"bytes": delta.numel() * delta.element_size(), "pseudo_gradient_norm": float(delta.norm())}
