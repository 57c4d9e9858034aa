"""Tasks the benchmarks train besides the GPT job (jobs.gpt)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_dp import Task, TrainConfig


def tiny_mlp() -> nn.Module:
    """32 -> 256 -> 1: a step whose compute is a few hundred microseconds on a CPU core, so
    what a step costs besides its compute shows."""
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))


class Regression32(Dataset):
    """64 x 256 samples of a fixed random linear target with noise."""

    def __init__(self, size: int = 64 * 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 32, generator=g)
        self.y = self.x @ torch.randn(32, 1, generator=g) + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


TINY_MLP_TASK = Task(model=tiny_mlp, dataset=Regression32, loss=mse, optimizer=sgd,
                     defaults=TrainConfig(global_batch=64, seed=0))


# -- a GPT that fills one large GPU (benchmarks/bench_gpu.py's utilisation figure) --------
FILL_CONTEXT, FILL_DIM, FILL_LAYERS, FILL_HEADS = 1024, 2048, 16, 16


def fill_gpt() -> nn.Module:
    from jobs.gpt import GPT

    return GPT(context=FILL_CONTEXT, dim=FILL_DIM, layers=FILL_LAYERS, heads=FILL_HEADS)


def fill_windows() -> Dataset:
    from jobs.gpt import ByteWindows, corpus

    return ByteWindows(corpus(), context=FILL_CONTEXT)


def _fill_task() -> Task:
    from jobs.gpt import build_optimizer, init_module, loss

    # FLOPs per window as jobs.gpt counts them: 6 x parameters per token plus attention
    params = 12 * FILL_LAYERS * FILL_DIM**2 + 13 * FILL_LAYERS * FILL_DIM + 256 * FILL_DIM \
        + FILL_CONTEXT * FILL_DIM + 2 * FILL_DIM
    flops = FILL_CONTEXT * (6 * params + 12 * FILL_LAYERS * FILL_DIM * FILL_CONTEXT)
    return Task(model=fill_gpt, dataset=fill_windows, loss=loss, optimizer=build_optimizer, init_module=init_module,
                tokens_per_sample=FILL_CONTEXT, flops_per_sample=flops,
                defaults=TrainConfig(steps=30, global_batch=16, micro_batch=16, precision="bf16"))


FILL_GPT_TASK = _fill_task()
