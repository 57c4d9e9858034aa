"""ZeRO stage 0: every worker holds the whole state. ``Replicated`` reduces the gradients
in buckets during backward (the sync mode's); ``Unreduced`` keeps them on the worker, for
a mode that reduces none (``--mode async``: the parameter servers apply them; ``--mode
diloco``: each member steps alone) and so builds no reducer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elastic_dp.comm.compression import make_compressor
from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reducer import GradientReducer
from elastic_dp.comm.reductions import all_reduce
from elastic_dp.config import TrainConfig
from elastic_dp.durable.checkpoint import REDUCTION, TrainingState, Wanted, load_optimizer_state, optimizer_state
from elastic_dp.faults import FaultHook
from elastic_dp.state.base import BucketedGradients, LocalGradients, WholeModel, broadcast_tensors, inside, nbytes
from elastic_dp.state.buffers import ModelBuffers


class ReplicatedState(WholeModel):
    """The whole model and optimizer state on every worker: all of ``Strategy`` but the
    gradients (``Replicated``, ``Unreduced``)."""

    params: list[torch.nn.Parameter]
    unused: Sequence[torch.nn.Parameter] = ()
    """Parameters the step's gradient reduction found no rank gave a gradient (none where
    the gradients are not reduced: the mode steps them as they are)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group: CollectiveGroup, device: torch.device) -> None:
        self.model, self.group, self.device = model, group, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.optimizer = optimizer
        self.buffers = ModelBuffers(model)

    def clip_grad_norm(self, max_norm: float) -> float:
        # Replicated's gradients are identical on every rank after the all-reduce (and
        # Unreduced's are the worker's own), so the local norm is the one to clip by.
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def optimizer_step(self, step: int) -> None:
        for p in self.unused:  # no rank gave it a gradient: torch's optimizers skip it
            p.grad = None
        self.optimizer.step()

    def skip_update(self, step: int) -> None:
        pass  # nothing moved: parameters and optimizer state stay as they are

    def after_commit(self, step: int) -> None:
        pass  # every worker holds the whole state: nothing to snapshot

    def settle(self) -> None:
        pass  # a step leaves nothing in flight

    def take_parameter_wait_s(self) -> float:
        return 0.0

    def drop_pending(self) -> None:
        pass

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The memory the gradients live in beside their own ``.grad`` tensors."""
        return []

    def state_bytes(self) -> dict[str, int]:
        buffers = self.gradient_buffers()
        return {"parameters": nbytes(self.params),
                "gradients": nbytes(buffers) + nbytes(
                    [p.grad for p in self.params if p.grad is not None and not inside(p.grad, buffers)]),
                "optimizer_state": nbytes([v for s in self.optimizer.state.values() for v in s.values()
                                            if isinstance(v, torch.Tensor)])}

    def sync_from(self, src: int) -> None:
        tensors = list(self.model.state_dict().values())
        for state in self.optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        broadcast_tensors(self.group, tensors, src, self.device)

    def state_part(self) -> tuple[dict[str, torch.Tensor], dict]:
        return optimizer_state(self.optimizer, self.names)

    def wanted(self) -> Wanted | None:
        return None  # a full replica needs everything

    def load(self, state: TrainingState) -> None:
        # copies: the optimizer steps its state in place (0-dim step counts stay on the CPU)
        tensors = {k: v.to(self.device, copy=True) if v.dim() > 0 else v.clone()
                   for k, v in state.optimizer_tensors.items()
                   if not k.endswith("/master")  # fp32 masters are ZeRO's; stage 0 has none
                   and not k.startswith(REDUCTION)}  # the reduction's own state: its rows, not the optimizer's
        load_optimizer_state(self.optimizer, self.names, tensors, state.optimizer_meta)


class Replicated(BucketedGradients, ReplicatedState):
    """ZeRO stage 0: full replicas, bucketed all-reduce overlapped with backward (no fault
    phase of its own: ``faults`` is taken as every stage's strategy takes it)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group: CollectiveGroup, config: TrainConfig, device: torch.device,
                 faults: FaultHook | None = None) -> None:
        super().__init__(model, optimizer, group, device)
        compressor = config.buckets.compressor
        self.reduction = (make_compressor(group, compressor, config.seed, config.buckets.compress_scope)
                          if compressor is not None
                          else all_reduce(group, config.buckets.all_reduce))
        self.reducer = GradientReducer(self.params, group,
                                       bucket_bytes=config.buckets.bucket_bytes,
                                       first_bucket_bytes=config.buckets.first_bucket_bytes(device.type),
                                       reduce_fp32=config.buckets.reduce_fp32, reduction=self.reduction)

    def gradient_buffers(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.reducer.buckets]


class Unreduced(LocalGradients, ReplicatedState):
    """Full replicas whose gradients stay each worker's own: no reducer is built."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group: CollectiveGroup, config: TrainConfig, device: torch.device) -> None:
        super().__init__(model, optimizer, group, device)
