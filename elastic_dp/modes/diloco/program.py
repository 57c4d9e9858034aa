"""Local SGD and DiLoCo, worker side: H inner steps alone, then one outer step together.

The worker side of ``--mode diloco`` (its driver half: ``modes.diloco``): a
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
  in fp32 (in bf16 with ``--outer-reduce bf16``: half the bytes, the sum rounded; with
  ``int8`` or ``int4`` blockwise-scaled integers, each member's quantization error added
  to its term of the next outer step of the same fragment: ``comm.quantize``; the errors
  are restored with the window's start, gone with a lost member, none for a joiner).
- The outer optimizer, torch's SGD (``outer_lr``, ``outer_momentum``; Nesterov unless
  plain momentum is asked; a momentum of 0 is plain SGD), steps θ_t with Δ as its
  gradient; every member then restarts from θ_{t+1}, identical on every member, and so
  is the outer optimizer's state. Local SGD is ``outer_lr=1, outer_momentum=0``.

Streaming (``fragments`` F, ``fragment_delay`` τ; F = 1, τ = 0 is the above): the
parameters are cut into F fragments (``fragments_of``) and fragment f is synced once a
window, sent after the window's inner step ⌊(f+1)·H/F⌋ − τ and used τ steps later: its Δ
from the parameters at the send, all-reduced while the τ steps train, θ_f stepped by the
outer SGD, and the member's fragment set to θ_f + (its parameters now − at the send), so
that no inner step's progress is dropped or counted twice. A member's parameters differ
from θ at a window's end in the fragments synced before it (they are kept, and saved).
After the run's last inner step every fragment not sent at that step is synced once more
(τ = 0): the final parameters are θ on every member. A joiner starts from θ.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator

import numpy as np
import torch

from elastic_dp.comm.quantize import BITS, QuantizedAllReduce
from elastic_dp.comm.reductions import AllReduce
from elastic_dp.data import ElasticSampler, split
from elastic_dp.durable.checkpoint import Checkpoint, Part, TrainingState, cut_part
from elastic_dp.errors import TaskError
from elastic_dp.faults import Fault
from elastic_dp.messages import StepResult
from elastic_dp.modes.diloco.settings import DiLoCoSettings
from elastic_dp.modes.program import Program
from elastic_dp.state.base import broadcast_tensors
from elastic_dp.task import trainable
from elastic_dp.threads import set_os_name
from elastic_dp.worker.replica import Replica, portable


def fragments_of(sizes: list[int], count: int) -> list[int]:
    """Each parameter's fragment: the parameters in order (of ``trainable``), cut into
    ``count`` runs of about equal size: a parameter of ``sizes[i]`` elements, with ``c``
    elements before it of ``C``, is in fragment ⌊count·(c + sizes[i]/2) / C⌋. Raises
    ``TaskError`` if a fragment is left empty (a parameter larger than a fragment's share)."""
    total, before, out = sum(sizes), 0, []
    for n in sizes:
        out.append(min(count - 1, count * (2 * before + n) // (2 * total)))
        before += n
    if len(set(out)) != count:
        empty = min(set(range(count)) - set(out))
        raise TaskError(f"--fragments {count}: cutting the model's {len(sizes)} parameters ({total} elements) by size "
                        f"leaves fragment {empty} empty; use fewer fragments")
    return out


@dataclass(slots=True)
class _Flight:
    """A fragment's pseudo-gradient on its way: sent, not yet used."""

    fragment: int
    handle: Any
    """The reduction's: once waited for, ``delta`` holds the sum."""
    bytes: int
    delta: torch.Tensor
    at_send: list[torch.Tensor] | None
    """The fragment's parameters at the send (with a delay: the steps after it are kept)."""
    step: int


class DiLoCoProgram(Program):
    """One member's inner steps and its part of the outer step, over a ``Replica`` whose
    group is the outer step's members. Its checkpoint part is its own (``checkpoint_part``),
    and it evaluates θ (``evaluating``)."""

    calls = frozenset({"window", "held", "restore", "sync_from"})

    def __init__(self, replica: Replica, settings: DiLoCoSettings | None = None) -> None:
        super().__init__(replica)
        settings = settings or replica.config.mode
        self.settings = settings
        reduce = settings.outer_reduce
        self.reduction = (QuantizedAllReduce(replica.group, BITS[reduce]) if reduce in BITS
                          else AllReduce(replica.group, torch.bfloat16 if reduce == "bf16" else None))
        """The pseudo-gradient's all-reduce, one fragment a launch (``--outer-reduce``: its dtype,
        or quantized integers with each member's error carried to its next outer step)."""
        named = trainable(replica.model, replica.optimizer)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        of = fragments_of([p.numel() for p in self.params], settings.fragments)
        self.fragments = [[i for i, g in enumerate(of) if g == f] for f in range(settings.fragments)]
        """The indices (into ``params``) of each fragment's parameters."""
        self.theta = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params]
        """θ_t, the outer parameters, fp32."""
        nesterov = settings.outer_nesterov and settings.outer_momentum > 0
        self.outer = torch.optim.SGD(self.theta, lr=settings.outer_lr, momentum=settings.outer_momentum,
                                     nesterov=nesterov)
        self.step = 0
        """The sampler steps θ has trained (an outer boundary)."""
        self._start: tuple[int, list[torch.Tensor], dict, dict, list[torch.Tensor] | None] | None = None
        """As of the start of the last window: its step, θ, the outer and the inner
        optimizer's state, and (streaming) the member's parameters."""
        self._fresh = True
        """Not yet started from any θ: a joiner's parameters become θ at ``sync_from``."""

    def held(self) -> int:
        """The sampler steps this rank's θ has trained (an outer boundary)."""
        return self.step

    def window(self, start: int, stop: int, sampler: dict[str, int], faults: dict[int, Fault]) -> dict:
        """Training thread: inner steps ``start .. stop - 1`` on this rank's slices, with
        each fragment's outer step at its point of the window (the last one's at its end),
        and after the run's last step the final sync. Returns each inner step's
        ``StepResult`` (``steps``: its summed loss and samples), each outer step's figures
        (``outer``) and the window's ``seconds``. It ends with its
        outer all-reduce, which the group's abort releases."""
        set_os_name("edp-train")
        replica = self.replica
        if start != self.step:
            raise ValueError(f"a window from step {start}, and theta has trained {self.step} steps")
        self._keep_start()
        batches = ElasticSampler(sampler["dataset_len"], global_batch=sampler["global_batch"], seed=sampler["seed"])
        group, batch, plan = replica.group, sampler["global_batch"], self.settings.schedule()
        steps, outer, samples, flight, began = [], [], 0, None, time.perf_counter()
        replica.progress.enter("compute")
        try:
            for done, s in enumerate(range(start, stop), start=1):
                replica.faults.arm(faults.get(s))
                mine = split(batches.batch(s), group.world_size)[group.rank]
                replica.read_ahead(s, lambda t: split(batches.batch(t), group.world_size)[group.rank],
                                   (group.generation, group.rank, group.world_size))
                result = self.inner_step(s, mine)
                replica.faults.disarm()
                steps.append(result)
                samples = len(mine)
                for f, (send, use) in enumerate(plan):
                    if send == done:
                        flight = self._send(f, samples, batch, s + 1)
                    if use == done:
                        outer.append(self._use(flight, s + 1))
                        flight = None
            if flight is not None:  # a short last window: the fragment in flight is used at its end
                outer.append(self._use(flight, stop))
            if stop == replica.config.steps:  # the final sync: every fragment not sent at the last step
                for f, (send, _) in enumerate(plan):
                    if send != stop - start:
                        outer.append(self._use(self._send(f, samples, batch, stop), stop))
        except Exception as exc:  # noqa: BLE001 — the task's, or the group's (a peer lost)
            raise portable(exc, group.rank, self.step) from None
        finally:
            replica.faults.disarm()
            replica.progress.enter("idle")
        self.step, self._fresh = stop, False
        return {"steps": steps, "outer": outer, "seconds": time.perf_counter() - began}

    def _keep_start(self) -> None:
        self.reduction.save()  # the quantization errors as of θ_t (--outer-reduce int8|int4)
        local = [p.detach().clone() for p in self.params] if self.settings.streaming else None
        self._start = (self.step, [t.detach().clone() for t in self.theta], copy.deepcopy(self.outer.state_dict()),
                       copy.deepcopy(self.replica.optimizer.state_dict()), local)

    @torch.no_grad()
    def restore(self, step: int) -> None:
        """Back to the state at outer boundary ``step``: the start of the last window (a
        window that failed, or that completed on this rank only), or now."""
        if self._start is not None and self._start[0] == step:
            _, theta, outer, inner, local = self._start
            for t, saved in zip(self.theta, theta):
                t.copy_(saved)
            self.outer.load_state_dict(outer)
            self.replica.optimizer.load_state_dict(inner)
            self.reduction.restore()
            for p, saved in zip(self.params, local or self.theta):
                p.copy_(saved)
        elif step != self.step:
            raise ValueError(f"no state of step {step} here (theta has trained {self.step} steps)")
        self.step = step

    @torch.no_grad()
    def sync_from(self, src: int, step: int) -> None:
        """A collective: θ and the outer optimizer's state from rank ``src`` (a joiner's are
        not yet anyone's), the model's buffers too; the inner optimizer's stays each rank's,
        and so do (streaming) a member's parameters; a joiner's become θ."""
        group, device = self.replica.group, self.replica.device
        for theta in self.theta:  # before the first outer step: zeros, which torch's first step treats as none
            if self.outer.state[theta].get("momentum_buffer") is None:
                self.outer.state[theta]["momentum_buffer"] = torch.zeros_like(theta)
        buffers = [self.outer.state[t]["momentum_buffer"] for t in self.theta]
        broadcast_tensors(group, [*self.theta, *buffers, *self.replica.strategy.buffers.tensors()], src, device)
        if self._fresh or not self.settings.streaming:
            for theta, p in zip(self.theta, self.params):
                p.copy_(theta)
        self.step, self._start, self._fresh = step, None, False

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
        """Every fragment's outer step at once (a collective of the members), this member
        having trained ``samples`` of each ``global_batch``-sample step since θ."""
        records = [self._use(self._send(f, samples, global_batch, self.step), self.step)
                   for f in range(len(self.fragments))]
        return {"bytes": sum(r["bytes"] for r in records),
                "pseudo_gradient_norm": sum(r["pseudo_gradient_norm"] ** 2 for r in records) ** 0.5}

    @torch.no_grad()
    def _send(self, f: int, samples: int, global_batch: int, step: int) -> _Flight:
        """Start fragment ``f``'s all-reduce of this member's (n_k / B)(θ_f − its parameters)."""
        share, index = samples / global_batch, self.fragments[f]
        delta = torch.cat([(self.theta[i] - self.params[i].detach().float()).reshape(-1) * share for i in index])
        at_send = [self.params[i].detach().clone() for i in index] if self.settings.fragment_delay else None
        return _Flight(f, self.reduction.launch(f, delta), self.reduction.wire_bytes(delta), delta, at_send, step)

    @torch.no_grad()
    def _use(self, flight: _Flight, step: int) -> dict[str, float]:
        """Wait for ``flight``'s Δ, step θ_f with it, and set the member's fragment to θ_f
        plus what it trained since the send. Returns the bytes its all-reduce carried and ‖Δ‖."""
        progress = self.replica.progress
        progress.enter("reduce")
        flight.handle.wait()
        progress.enter("compute")
        delta, index = flight.delta, self.fragments[flight.fragment]
        offset = 0
        for i in index:
            self.theta[i].grad = delta[offset:offset + self.theta[i].numel()].view_as(self.theta[i])
            offset += self.theta[i].numel()
        self.outer.step()  # the parameters without a gradient (the other fragments) are not stepped
        for j, i in enumerate(index):
            theta, p = self.theta[i], self.params[i]
            theta.grad = None
            p.copy_(theta if flight.at_send is None else theta + (p - flight.at_send[j]))
        return {"fragment": flight.fragment, "sent_step": flight.step, "step": step,
                "bytes": flight.bytes, "pseudo_gradient_norm": float(delta.norm())}

    def evaluating(self) -> ContextManager[None]:
        """A member's own parameters can differ from θ (streaming): the run's are θ."""
        return self.at_theta()

    @contextmanager
    def at_theta(self) -> Iterator[None]:
        """The model's parameters are θ inside (streaming: a member's own are put back after)."""
        if not self.settings.streaming:
            yield
            return
        local = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for theta, p in zip(self.theta, self.params):
                p.copy_(theta)
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, p in zip(local, self.params):
                    p.copy_(saved)

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

        def row(key: str, value: torch.Tensor) -> None:  # this rank's row of an [N, *shape] tensor
            tensors[key] = value.detach().reshape(-1)
            slices[key] = [group.rank * value.numel(), [group.world_size, *value.shape]]

        # cut_part copies every piece it keeps to host memory
        for name, p, theta in zip(self.names, self.params, self.theta):
            buffer = self.outer.state[theta].get("momentum_buffer")
            if buffer is not None:
                tensors[f"outer/{name}/momentum_buffer"] = buffer.detach()
            for key, value in replica.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim():
                    row(f"inner/{name}/{key}", value)
                elif isinstance(value, torch.Tensor):
                    tensors[f"inner/{name}/{key}"] = value.detach()
            if self.settings.streaming:  # a copy: at_theta puts θ in p while the pieces are cut
                row(f"local/{name}", p.detach().clone())
        for key, error in self.reduction.state().items():  # each member's quantization error: a row
            row(f"quantized/{key}", error.detach().clone())
        meta = {"diloco": {"world_size": group.world_size}, "slices": slices}
        with self.at_theta():  # the model's state dict holds θ while its pieces are cut
            part = cut_part(TrainingState(step=step, model=replica.model.state_dict(), optimizer_tensors=tensors,
                                          optimizer_meta=meta, sampler=sampler, world_size=group.world_size,
                                          rng=torch.get_rng_state()), group.rank, group.world_size)
        if part.meta:  # rank 0's: the scheduler's state beside the run's layout
            replica.add_scheduler(part.meta, step)
        return part

    @torch.no_grad()
    def load_checkpoint(self, checkpoint: Checkpoint) -> TrainingState:
        """θ and the outer momentum from ``checkpoint``; this rank's inner optimizer state,
        (streaming) its parameters and (``--outer-reduce int8|int4``) its quantization errors
        where they were saved at this world size (each rank its own row), else a fresh
        optimizer, θ and no error (the rows belong to slices of another world size; what they
        had trained since their fragments' last syncs is not in θ)."""
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
            local = saved.get(f"local/{name}") if same and self.settings.streaming else None
            if local is not None:
                p.copy_(local[group.rank])
        # each member's quantization error (--outer-reduce int8|int4): its own row at the saved
        # world size; at another one none, as its inner optimizer state (docs/diloco.md)
        rows = {k.removeprefix("quantized/"): v for k, v in saved.items() if k.startswith("quantized/")}
        self.reduction.load_state({k: v[group.rank].to(replica.device).clone() for k, v in rows.items()}
                                  if same else {})
        torch.set_rng_state(state.rng)
        self.step, self._start, self._fresh = state.step, None, False
        replica.load_scheduler(state)
        return state
