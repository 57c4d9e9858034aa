"""Small tasks for the tests: fast on one CPU thread, deterministic, importable by workers."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_dp import ElasticSampler, Task, TrainConfig
from jobs import gpt


class Regression(Dataset):
    """``n`` samples of a fixed random non-linear regression problem."""

    def __init__(self, n: int = 96, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.sin(self.x @ torch.randn(dim, 1, generator=g)) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def sgd_two_groups(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum; the first layer gets its own learning rate and weight decay."""
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return torch.optim.SGD([{"params": first, "lr": 0.05, "weight_decay": 1e-3},
                            {"params": rest}], lr=0.1, momentum=0.9)


MLP_TASK = Task(model=mlp, dataset=Regression, loss=mse, optimizer=sgd_two_groups,
                defaults=TrainConfig(steps=8, global_batch=10, micro_batch=2, seed=3))

def warmup_then_exponential(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A torch scheduler that reads the rate it left in the optimizer (chained): a linear
    warmup over 3 steps, then x0.8 a step."""
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer, [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=3),
                    torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8)], milestones=[3])


def halving(step: int) -> float:
    """A ``Task.lr_schedule``: the rate halves every 3 steps."""
    return 0.5 ** (step // 3)


SCHEDULED_TASK = dataclasses.replace(MLP_TASK, scheduler=warmup_then_exponential)

# the first sample of step 3 (so rank 0's, whatever the worker count)
POISONED = int(ElasticSampler(96, global_batch=10, seed=3).batch(3)[0])


class PoisonedRegression(Regression):
    """``Regression`` with a NaN in sample ``POISONED``: step 3's loss is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.x[POISONED, 0] = float("nan")


POISONED_TASK = Task(model=mlp, dataset=PoisonedRegression, loss=mse, optimizer=sgd_two_groups,
                     defaults=MLP_TASK.defaults)

# the first samples of steps 3 and 4: two steps in a row with a NaN loss
POISONED_TWICE = [int(ElasticSampler(96, global_batch=10, seed=3).batch(s)[0]) for s in (3, 4)]


class TwicePoisonedRegression(Regression):
    """``Regression`` with a NaN in the samples ``POISONED_TWICE``: steps 3 and 4's losses are NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.x[POISONED_TWICE, 0] = float("nan")


TWICE_POISONED_TASK = dataclasses.replace(POISONED_TASK, dataset=TwicePoisonedRegression)


class IndexedRegression(Regression):
    """``Regression`` whose samples carry their index: ``(x, y, index)``."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return (*super().__getitem__(i), i)


@dataclasses.dataclass(frozen=True)
class PacedLoss:
    """The MLP's loss on ``IndexedRegression``, after sleeping ``seconds`` per call, or
    ``slow_seconds`` when the batch holds a sample of ``slow``. With ``block``: the first
    call that meets that sample blocks forever (the marker file records that one did), its
    process still answering. With ``record`` (a directory): each call appends the sample
    indices it trained to ``record/<pid>.txt``, one micro-batch per line. With ``until`` (a
    path): no sleep once that file exists (a scenario whose events are over runs its last
    steps at full speed)."""

    seconds: float = 0.0
    slow: frozenset[int] = frozenset()
    slow_seconds: float = 0.0
    block: int | None = None
    marker: str | None = None
    record: str | None = None
    until: str | None = None

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        x, y, index = batch
        held = set(index.tolist())
        if self.record is not None:
            with open(os.path.join(self.record, f"{os.getpid()}.txt"), "a") as f:
                f.write(" ".join(map(str, index.tolist())) + "\n")
        if self.block in held and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            threading.Event().wait()
        if self.until is None or not os.path.exists(self.until):
            time.sleep(self.slow_seconds if held & self.slow else self.seconds)
        return mse(model, (x, y))


def mlp_units(model: nn.Module) -> list[nn.Module]:
    """``Task.shard_units`` of the MLP (no ModuleList): its first two Linear layers; the last is the root."""
    return [model[0], model[2]]


def paced_task(loss: PacedLoss, **defaults) -> Task:
    return Task(model=mlp, dataset=IndexedRegression, loss=loss, optimizer=sgd_two_groups,
                defaults=dataclasses.replace(MLP_TASK.defaults, **defaults))


@dataclasses.dataclass(frozen=True)
class PacedGPTLoss:
    """The GPT job's loss after sleeping ``seconds`` per call, until the file ``until`` exists
    (a scenario that must act while the run trains: the replay uses ``gpt.loss``)."""

    seconds: float
    until: str

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        if not os.path.exists(self.until):
            time.sleep(self.seconds)
        return gpt.loss(model, batch)


def tiny_gpt() -> nn.Module:
    return gpt.GPT(context=16, dim=32, layers=2, heads=2)


def tiny_corpus() -> Dataset:
    return gpt.ByteWindows(gpt.corpus(40_000), context=16)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


@dataclasses.dataclass(frozen=True)
class BlockedOnceMarked:
    """``tiny_gpt``, except that once ``marker`` exists, building the model blocks forever:
    a worker started after that never becomes ready."""

    marker: str

    def __call__(self) -> nn.Module:
        if os.path.exists(self.marker):
            threading.Event().wait()
        return tiny_gpt()


def tiny_held_out() -> Dataset:
    """The 4,000 bytes of the corpus after the tiny GPT's 40,000: 249 windows."""
    return gpt.ByteWindows(gpt.corpus(44_000)[40_000:], context=16)


TINY_GPT_TASK = Task(model=tiny_gpt, dataset=tiny_corpus, loss=gpt.loss, optimizer=adamw, eval_dataset=tiny_held_out,
                     init_module=gpt.init_module,
                     defaults=TrainConfig(steps=6, global_batch=12, micro_batch=4, seed=5,
                                          warmup_steps=2, clip_grad_norm=1.0))


def vector_loss(model: nn.Module, batch) -> torch.Tensor:
    """A broken loss: per-sample values instead of a scalar."""
    x, y = batch
    return ((model(x) - y) ** 2).squeeze(-1)


BAD_LOSS_TASK = Task(model=mlp, dataset=Regression, loss=vector_loss, optimizer=sgd_two_groups,
                     defaults=TrainConfig(steps=2, global_batch=8))


class Images(Dataset):
    """``n`` one-channel 6x6 images in 3 classes, the class shifting their brightness."""

    def __init__(self, n: int = 120) -> None:
        g = torch.Generator().manual_seed(99)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 1, 6, 6, generator=g) + self.y.view(-1, 1, 1, 1).float()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def small_cnn() -> nn.Module:
    """A convolution, BatchNorm2d, and a classifier with BatchNorm1d: running statistics
    of both kinds, and ``num_batches_tracked``."""
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def sgd_momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


CNN_TASK = Task(model=small_cnn, dataset=Images, loss=cross_entropy, optimizer=sgd_momentum,
                defaults=TrainConfig(steps=10, global_batch=12, seed=5))

# the first sample of step 2: its loss and the batch-norm statistics of its forward are NaN
POISONED_IMAGE = int(ElasticSampler(120, global_batch=12, seed=5).batch(2)[0])


class PoisonedImages(Images):
    def __init__(self) -> None:
        super().__init__()
        self.x[POISONED_IMAGE] = float("nan")


POISONED_CNN_TASK = dataclasses.replace(CNN_TASK, dataset=PoisonedImages)


class _KillsAt(Dataset):
    def __init__(self, inner: Dataset, index: int, marker: str) -> None:
        self.inner, self.index, self.marker = inner, index, marker

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if i == self.index:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass  # another process died of it already
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[i]


@dataclasses.dataclass(frozen=True)
class KillsAt:
    """``dataset``'s, except that the first process to fetch sample ``index`` SIGKILLs
    itself (creating ``marker`` first; later fetches are plain): a worker lost while it
    computes whichever step holds the sample, whatever its rank."""

    dataset: object
    index: int
    marker: str

    def __call__(self) -> Dataset:
        return _KillsAt(self.dataset(), self.index, self.marker)


class Deep(nn.Module):
    """An input layer, ``blocks`` equal hidden layers in a ModuleList (the default shard
    units) and an output layer: nearly all of its parameters are in the units."""

    def __init__(self, width: int = 64, blocks: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


DEEP_TASK = Task(model=Deep, dataset=Regression, loss=mse, optimizer=adamw,
                 defaults=TrainConfig(steps=6, global_batch=12, seed=7))


def no_optimizer(model: nn.Module) -> None:
    """An optimizer factory that forgets to return what it built."""
    torch.optim.SGD(model.parameters(), lr=0.1)


class NoParameters(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1, keepdim=True)


def plain_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


NO_OPTIMIZER_TASK = dataclasses.replace(MLP_TASK, optimizer=no_optimizer)
NO_PARAMETERS_TASK = dataclasses.replace(MLP_TASK, model=NoParameters, optimizer=plain_sgd)


class MoEBlock(nn.Module):
    """A Mixture-of-Experts layer as a research user writes one: a router, one module per
    expert in a ``ModuleList``, top-1 routing. An expert that no sample of a step chooses
    takes no part in the forward, and in a plain loop its gradient stays ``None``."""

    def __init__(self, dim: int = 8, experts: int = 16, hidden: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, hidden) for _ in range(experts))
        self.hidden = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        top = probs.argmax(-1)
        out = x.new_zeros(x.shape[0], self.hidden)
        for e, expert in enumerate(self.experts):
            chosen = top == e
            if chosen.any():
                out[chosen] = torch.tanh(expert(x[chosen])) * probs[chosen, e:e + 1]
        return out


class MoEModel(nn.Module):
    """The MoE layer as the model itself, its experts a ``ModuleList`` of the model: at
    ZeRO-3 each expert is a unit of its own (the default units), which the samples of a
    step choose differently on each rank."""

    def __init__(self) -> None:
        super().__init__()
        layer = MoEBlock()
        self.router, self.experts, self.hidden = layer.router, layer.experts, layer.hidden
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(MoEBlock.forward(self, x))


class MoENet(nn.Module):
    """One MoE block (in a ``ModuleList``, as a transformer's blocks: ZeRO-3's unit, which
    every sample passes through) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MoEBlock()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def moe_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


MOE_TASK = Task(model=MoEModel, dataset=Regression, loss=mse, optimizer=moe_adamw, eval_dataset=Regression,
                defaults=TrainConfig(steps=12, global_batch=8, seed=11))
MOE_BLOCK_TASK = dataclasses.replace(MOE_TASK, model=MoENet)


def parquet_regression(n: int, seed: int = 0) -> list[pa.Table]:
    """Three tables of a regression problem (``x``: 8 floats a row, ``y``: one), unequal sizes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = np.sin(x @ rng.standard_normal(8)).astype(np.float32)[:, None]
    cuts = [0, n // 3, n // 3 + n // 4, n]
    return [pa.table({"x": pa.array(list(x[a:b]), type=pa.list_(pa.float32(), 8)),
                      "y": pa.array(list(y[a:b]), type=pa.list_(pa.float32(), 1)),
                      "id": pa.array(np.arange(a, b))}) for a, b in itertools.pairwise(cuts)]


def write_parquet(tables: list[pa.Table], uri: str, row_group_size: int = 20) -> None:
    """``tables`` as ``part-00.parquet`` … under ``uri`` (any ``pyarrow.fs`` URI)."""
    fs, root = pafs.FileSystem.from_uri(uri)
    fs.create_dir(root)
    for k, table in enumerate(tables):
        with fs.open_output_stream(f"{root}/part-{k:02d}.parquet") as out:
            pq.write_table(table, out, row_group_size=row_group_size)


def parquet_mse(model: nn.Module, batch) -> torch.Tensor:
    """The MSE of ``mlp`` on a batch of ``ParquetRows`` of ``parquet_regression``."""
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def _regression_rows(batch: dict) -> dict:
    """``map_batches``' transform of ``ray_regression``: 8 features and a target of each id."""
    ids = batch["id"].astype(np.float64)
    x = np.stack([np.sin(ids * 0.37 * (k + 1)) for k in range(8)], axis=1).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)}


def ray_regression(rows: int = 150, blocks: int = 6):
    """A Ray Dataset of a regression problem (``ray.data.range`` and a ``map_batches``), in
    a deterministic order (``preserve_order``): ``parquet_mse`` trains ``mlp`` on it."""
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    return ray.data.range(rows, override_num_blocks=blocks).map_batches(_regression_rows)


def ray_rows_listed(factory=ray_regression) -> list:
    """The replay's dataset of a Ray Dataset factory: its rows as ``iter_rows`` lists them."""
    return list(factory().iter_rows())


def write_hf_regression(path: str, rows: int = 150) -> None:
    """A Hugging Face ``datasets`` dataset of ``parquet_regression``'s rows, saved as its Arrow files."""
    import datasets

    datasets.disable_progress_bars()
    table = pa.concat_tables(parquet_regression(rows, seed=7))
    datasets.Dataset(table).save_to_disk(path)


def hf_rows(path: str):
    """The dataset ``write_hf_regression`` saved, loaded as users load one (memory-mapped
    Arrow files, map-style), its rows as numpy (``default_collate`` makes the tensors)."""
    import datasets

    return datasets.load_from_disk(path).with_format("numpy")
