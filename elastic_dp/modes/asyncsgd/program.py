"""Asynchronous SGD, worker side: the gradient of one whole sampler step on pulled parameters.

The worker joins no collective group: it copies the parameter-server shards' pieces of
one version into its model, computes the gradient of the step's whole global batch (in
micro-batches), clips it by its own norm, and returns it cut into one piece per shard
(``elastic_dp.modes.asyncsgd.shard``; the driver side is ``modes.asyncsgd``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from elastic_dp.data import ElasticSampler
from elastic_dp.faults import Fault
from elastic_dp.messages import StepResult
from elastic_dp.modes.program import Program
from elastic_dp.state.zero.chunks import check_elementwise
from elastic_dp.task import trainable
from elastic_dp.worker.replica import Replica, portable


class AsyncProgram(Program):
    """The asynchronous mode's worker side, over a ``Replica`` (no window to end on an
    abort or a leave: a gradient is one call)."""

    calls = frozenset({"gradient"})

    def __init__(self, replica: Replica) -> None:
        check_elementwise(replica.optimizer, "async")  # its parameter servers shard the optimizer state
        super().__init__(replica)

    def gradient(self, step: int, sampler: dict[str, int], bounds: list[int], fault: Fault | None,
                 slow: Fault | None, *pieces: np.ndarray,
                 buffers: dict[str, torch.Tensor] | None = None) -> tuple[dict | np.ndarray, ...]:
        """The driver's call (``AsyncMode``, with Ray resolving the shards' pulled pieces
        into ``pieces``): ``fault`` armed for it, ``slow`` slowing it; the report, then one
        gradient piece per shard (``compute``)."""
        self.replica.faults.arm(fault)
        self.replica.faults.slow = slow
        report, grads = self.compute(step, sampler, bounds, list(pieces), buffers)
        return (report, *grads)

    def compute(self, step: int, sampler: dict[str, int], bounds: list[int], pieces: list[np.ndarray],
                buffers: dict[str, torch.Tensor] | None = None) -> tuple[dict, list[np.ndarray]]:
        """The gradient of sampler step ``step`` on the parameters ``pieces`` (the shards'
        flat fp32 pieces of one version) and the model's ``buffers`` of that version,
        clipped by its own norm, cut at ``bounds`` into one flat piece per shard. Also a
        small report: loss, whether loss and gradient are finite, the error of the task if
        it raised, and what the forward changed in the buffers (``buffer_change``, which
        the update adds to them when it is applied). The faults armed for it fire at their
        phases (``forward``); a slow one, set on the hook, slows it.

        Pieces travel as NumPy arrays, which Ray reads from its object store without a
        copy (torch tensors it would unpickle into new memory): the pulled pieces are read
        in place, and each returned piece is a view of one host copy of the gradient."""
        replica = self.replica
        indices = ElasticSampler(sampler["dataset_len"], global_batch=sampler["global_batch"],
                                 seed=sampler["seed"]).batch(step)
        params = [p for _, p in trainable(replica.model, replica.optimizer)]
        flat = torch.empty(bounds[-1], dtype=torch.float32)
        for piece, lo, hi in zip(pieces, bounds, bounds[1:]):
            np.copyto(flat.numpy()[lo:hi], piece)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        tracked = replica.strategy.buffers
        if buffers is not None and tracked:
            tracked.load(buffers)
        if not replica.model.training:
            replica.model.train()
        replica.strategy.zero_grad()  # the gradients live in its buckets; no collective is used
        report = {"error": None, "finite": True, "loss_finite": True, "loss": None, "grad_norm": None,
                  "compute_s": 0.0, "buffer_change": None}
        result = StepResult(step=step, rank=0, generation=0, committed=False)
        start = time.perf_counter()
        replica.progress.enter("compute")  # the watchdog judges a stalled gradient by this phase
        try:
            replica.forward_backward(replica.collate(indices), result, vote=False)
        except Exception as exc:
            report["error"] = portable(exc, 0, -1)
            return report, [np.zeros(0, dtype=np.float32) for _ in bounds[1:]]
        finally:
            replica.faults.slow = None
            replica.faults.disarm()
            replica.progress.enter("idle")
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if replica.config.clip_grad_norm is not None:
            report["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, replica.config.clip_grad_norm))
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat_grad = torch.cat([g.detach().reshape(-1).float() for g in grads]).cpu()
        report["loss_finite"] = result.loss_finite
        report["finite"] = result.loss_finite and bool(torch.isfinite(flat_grad).all())
        report["loss"] = result.loss_sum / max(1, result.samples)
        report["compute_s"] = time.perf_counter() - start
        if buffers is not None and tracked:
            report["buffer_change"] = {k: v - buffers[k].to(v.dtype) for k, v in tracked.copy().items()}
        host = flat_grad.numpy()  # Ray writes each view's own bytes into its store, no more
        return report, [host[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
