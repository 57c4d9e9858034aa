"""Local SGD and DiLoCo, worker side: H inner steps alone, then one outer step together.

The worker side of ``--mode diloco`` (its driver half: ``control.modes.diloco``): a
window is one outer step, its H inner steps granted in one call (``window``). The state
as of the window's start (θ_t, the outer optimizer's, the inner optimizer's) is kept until
the next one starts, so that a window a failure interrupted, on any rank and at any point,
is re-run from it (``restore``); a joiner takes θ_t and the outer state from rank 0
(``sync_from``) and starts its inner optimizer fresh.

The contract, for the members k = 0 .. N-1 of one outer step t, with slices of n_k of
the global batch B (``split``: contiguous, as in sync mode):

- Every member starts from the same θ_t. Inner step h = 0 .. H-1 trains on sampler step
  s = t·H + h, on the member's slice of it: the task's loss, the mean over its own
  samples; its own gradient clipped by ``clip_grad_norm``; the base rates times the
  schedule's factor of s; the task's optimizer, whose state stays with the member
  across outer steps.
- The pseudo-gradient Δ = θ_t − Σ_k (n_k / B)·θ_k (the sample-weighted mean: uneven
  slices count by their samples) is one SUM all-reduce of each member's (n_k / B)(θ_t − θ_k),
  in fp32 (in bf16 with ``--outer-reduce bf16``: half the bytes, the sum rounded).
- The outer optimizer, torch's SGD (``outer_lr``, ``outer_momentum``; Nesterov unless
  plain momentum is asked; a momentum of 0 is plain SGD), steps θ_t with Δ as its
  gradient; every member then restarts from θ_{t+1}, identical on every member, and so
  is the outer optimizer's state. Local SGD is ``outer_lr=1, outer_momentum=0``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch

from elastic_dp.data import ElasticSampler, split
from elastic_dp.durable.checkpoint import Checkpoint, Part, TrainingState, cut_part
from elastic_dp.faults import Fault
from elastic_dp.messages import StepResult
from elastic_dp.state.base import broadcast_tensors
from elastic_dp.task import trainable
from elastic_dp.worker.replica import Replica, portable


@dataclass(frozen=True, slots=True)
class OuterSettings:
    """The outer loop: ``sync_every`` inner steps (H) per outer step, the outer SGD."""

    sync_every: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    reduce: str = "fp32"
    """The dtype of the pseudo-gradient's all-reduce (``--outer-reduce``)."""

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_lr must be > 0 and outer_momentum in [0, 1), got {self.outer_lr}, "
                             f"{self.outer_momentum}")


class DiLoCoProgram:
    """One member's inner steps and its part of the outer step, over a ``Replica`` whose
    group is the outer step's members."""

    def __init__(self, replica: Replica, settings: OuterSettings | None = None) -> None:
        config = replica.config
        settings = settings or OuterSettings(sync_every=config.sync_every, outer_lr=config.outer_lr,
                                             outer_momentum=config.outer_momentum, nesterov=config.outer_nesterov,
                                             reduce=config.outer_reduce)
        self.replica, self.settings = replica, settings
        named = trainable(replica.model, replica.optimizer)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.theta = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params]
        """θ_t, the outer parameters, fp32."""
        nesterov = settings.nesterov and settings.outer_momentum > 0
        self.outer = torch.optim.SGD(self.theta, lr=settings.outer_lr, momentum=settings.outer_momentum,
                                     nesterov=nesterov)
        self.step = 0
        """The sampler steps θ has trained (an outer boundary)."""
        self._start: tuple[int, list[torch.Tensor], dict, dict] | None = None
        """As of the start of the last window: its step, θ, the outer and the inner optimizer's state."""

    def abort(self) -> None:
        pass  # a window ends with its outer all-reduce, which the group's abort releases

    def window(self, start: int, stop: int, sampler: dict[str, int], faults: dict[int, Fault]) -> dict:
        """Training thread: inner steps ``start .. stop - 1`` on this rank's slices, then the
        outer step. Returns, per inner step, the summed loss and the samples, and the outer
        step's figures; a task error is returned (``error``), not raised, after the outer
        step's collective is released by the others' failure."""
        replica = self.replica
        if start != self.step:
            raise ValueError(f"a window from step {start}, and theta has trained {self.step} steps")
        self._keep_start()
        batches = ElasticSampler(sampler["dataset_len"], global_batch=sampler["global_batch"], seed=sampler["seed"])
        group = replica.group
        steps, samples, began = [], 0, time.perf_counter()
        replica.progress.enter("compute")
        try:
            for s in range(start, stop):
                replica.faults.arm(faults.get(s))
                mine = split(batches.batch(s), group.world_size)[group.rank]
                result = self.inner_step(s, mine)
                replica.faults.disarm()
                steps.append((s, result.loss_sum, result.samples, result.loss_finite))
                samples = len(mine)
            replica.progress.enter("reduce")
            outer = self.outer_step(samples, sampler["global_batch"])
        except Exception as exc:  # noqa: BLE001 — the task's, or the group's (a peer lost)
            raise portable(exc, group.rank, self.step) from None
        finally:
            replica.faults.disarm()
            replica.progress.enter("idle")
        self.step = stop
        return {"steps": steps, "outer": outer, "seconds": time.perf_counter() - began}

    def _keep_start(self) -> None:
        self._start = (self.step, [t.detach().clone() for t in self.theta], copy.deepcopy(self.outer.state_dict()),
                       copy.deepcopy(self.replica.optimizer.state_dict()))

    @torch.no_grad()
    def restore(self, step: int) -> None:
        """Back to the state at outer boundary ``step``: the start of the last window (a
        window that failed, or that completed on this rank only), or now."""
        if self._start is not None and self._start[0] == step:
            _, theta, outer, inner = self._start
            for t, saved in zip(self.theta, theta):
                t.copy_(saved)
            self.outer.load_state_dict(outer)
            self.replica.optimizer.load_state_dict(inner)
        elif step != self.step:
            raise ValueError(f"no state of step {step} here (theta has trained {self.step} steps)")
        for theta, p in zip(self.theta, self.params):
            p.copy_(theta)
        self.step = step

    @torch.no_grad()
    def sync_from(self, src: int, step: int) -> None:
        """A collective: θ and the outer optimizer's state from rank ``src`` (a joiner's are
        not yet anyone's), the model's buffers too; the inner optimizer's stays each rank's."""
        group, device = self.replica.group, self.replica.device
        for theta in self.theta:  # before the first outer step: zeros, which torch's first step treats as none
            if self.outer.state[theta].get("momentum_buffer") is None:
                self.outer.state[theta]["momentum_buffer"] = torch.zeros_like(theta)
        buffers = [self.outer.state[t]["momentum_buffer"] for t in self.theta]
        broadcast_tensors(group, [*self.theta, *buffers, *self.replica.strategy.buffers.tensors()], src, device)
        for theta, p in zip(self.theta, self.params):
            p.copy_(theta)
        self.step, self._start = step, None

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
        sent = delta.to(torch.bfloat16) if self.settings.reduce == "bf16" else delta
        self.replica.group.all_reduce(sent)
        if sent is not delta:
            delta.copy_(sent)
        offset = 0
        for theta in self.theta:
            theta.grad = delta[offset:offset + theta.numel()].view_as(theta)
            offset += theta.numel()
        self.outer.step()
        for theta, p in zip(self.theta, self.params):
            theta.grad = None
            p.copy_(theta)
        return {"bytes": sent.numel() * sent.element_size(), "pseudo_gradient_norm": float(delta.norm())}

    # -- checkpoints, at outer boundaries --------------------------------------------------------
    def checkpoint_part(self, step: int, sampler: dict[str, int]) -> Part:
        """This rank's share of a checkpoint after outer boundary ``step``: its range of θ
        (the model's state dict) and of the outer momentum, as every rank holds them, and its
        own row of each inner optimizer-state tensor (``inner/<name>/<key>``, of shape
        ``[N, *shape]``: one row a rank)."""
        replica, group = self.replica, self.replica.group
        if step != self.step:
            raise ValueError(f"a checkpoint of step {step}, and theta has trained {self.step} steps")
        tensors, slices = {}, {}
        for name, p, theta in zip(self.names, self.params, self.theta):
            buffer = self.outer.state[theta].get("momentum_buffer")
            if buffer is not None:
                tensors[f"outer/{name}/momentum_buffer"] = buffer.detach().to("cpu", copy=True)
            for key, value in replica.optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                value = value.detach().to("cpu", copy=True)
                tensors[f"inner/{name}/{key}"] = value if value.dim() == 0 else value.reshape(-1)
                if value.dim():
                    slices[f"inner/{name}/{key}"] = [group.rank * value.numel(), [group.world_size, *value.shape]]
        meta = {"diloco": {"world_size": group.world_size}, "slices": slices}
        part = cut_part(TrainingState(step=step, model=replica.model.state_dict(), optimizer_tensors=tensors,
                                      optimizer_meta=meta, sampler=sampler, world_size=group.world_size,
                                      rng=torch.get_rng_state()), group.rank, group.world_size)
        if part.meta:  # rank 0's: the scheduler's state beside the run's layout
            replica._add_scheduler(part.meta, step)
        return part

    @torch.no_grad()
    def load_checkpoint(self, checkpoint: Checkpoint) -> TrainingState:
        """θ and the outer momentum from ``checkpoint``; this rank's inner optimizer state
        where it was saved at this world size (each rank its own row), else a fresh one (the
        rows belong to slices of another world size)."""
        replica, group = self.replica, self.replica.group
        state = checkpoint.read()
        replica.model.load_state_dict({k: v.to(replica.device) for k, v in state.model.items()})
        saved = state.optimizer_tensors
        same = state.optimizer_meta["diloco"]["world_size"] == group.world_size
        replica.optimizer.state.clear()
        for name, p, theta in zip(self.names, self.params, self.theta):
            theta.copy_(p)
            buffer = saved.get(f"outer/{name}/momentum_buffer")
            self.outer.state[theta] = {} if buffer is None else {"momentum_buffer": buffer.to(theta.device).clone()}
            prefix = f"inner/{name}/"
            inner = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)} if same else {}
            if inner:
                replica.optimizer.state[p] = {k: v.clone() if v.dim() == 0 else v[group.rank].to(p.device).clone()
                                              for k, v in inner.items()}
        torch.set_rng_state(state.rng)
        self.step, self._start = state.step, None
        replica._load_scheduler(state)
        return state
