"""ZeRO stage 0: every worker holds the whole state."""

from __future__ import annotations

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reducer import GradientReducer
from elastic_dp.config import TrainConfig
from elastic_dp.durable.checkpoint import TrainingState, Wanted, load_optimizer_state, optimizer_state
from elastic_dp.state.base import BucketedGradients, WholeModel, broadcast_tensors, inside, nbytes
from elastic_dp.state.buffers import ModelBuffers


class Replicated(BucketedGradients, WholeModel):
    """ZeRO stage 0: full replicas, bucketed all-reduce overlapped with backward."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group: CollectiveGroup, config: TrainConfig, device: torch.device) -> None:
        self.model, self.group, self.device = model, group, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.optimizer = optimizer
        self.buffers = ModelBuffers(model)
        self.reducer = GradientReducer(self.params, group,
                                       bucket_bytes=config.buckets.bucket_bytes,
                                       first_bucket_bytes=config.buckets.first_bucket_bytes(device.type),
                                       reduce_fp32=config.buckets.reduce_fp32)

    def clip_grad_norm(self, max_norm: float) -> float:
        # Gradients are identical on every rank after the all-reduce, so the local norm
        # is the global norm and no further communication is needed.
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def optimizer_step(self, step: int) -> None:
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

    def state_bytes(self) -> dict[str, int]:
        buffers = [b.buffer for b in self.reducer.buckets]
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
                   if not k.endswith("/master")}  # fp32 masters are ZeRO's; stage 0 has none
        load_optimizer_state(self.optimizer, self.names, tensors, state.optimizer_meta)
