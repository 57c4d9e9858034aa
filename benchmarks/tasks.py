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
