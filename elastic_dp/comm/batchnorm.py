"""Batch-norm statistics over the step's global batch (``--batch-stats global``).

SyncBatchNorm's semantics on any backend: in training, each batch-norm module of the model
normalises over the samples of every member's slice, not its own. Its forward shares each
rank's per-channel mean, variance and count (the exact parallel combination: the global
variance is the count-weighted mean of the local variances plus that of the squared
distances of the local means from the global one), and its backward sums the two
per-channel terms the input's gradient needs over the ranks; the weight and bias get the
local gradients, which the step's gradient reduction sums as any other. With the loss of
each slice scaled by its share of the global batch (``docs/design.md``, fixed global batch), a
step equals one forward of the whole global batch in one process, whatever the world size.
torch's ``SyncBatchNorm`` needs a GPU and a default process group; this runs on gloo and
NCCL, on the collective group's second process group (``CollectiveGroup.side``).

Collectives in forward and backward must match on every rank: each module's forward makes
one and its backward one, each of one size whatever the module. A rank whose forward
failed, or that has no sample this step, makes the rest with nothing in them
(``complete_step``), so its peers never wait; the step then does not commit (or, for an
empty slice, counts no sample of it). One forward per worker and step: a slice is not cut
into micro-batches (``TrainConfig.batch_stats`` refuses ``micro_batch``).
"""

from __future__ import annotations

import itertools

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.errors import TaskError


def batch_norm_modules(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s batch-norm modules (their statistics are a batch's)."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


class GlobalBatchStats:
    """Makes a model's batch-norm modules normalise over the global batch; counts the
    step's collectives so that a rank can complete them."""

    def __init__(self, model: torch.nn.Module, group: CollectiveGroup) -> None:
        self.group = group
        self.modules = [m for m in model.modules() if isinstance(m, _BatchNorm)]
        self.width = 2 * max(m.num_features for m in self.modules) + 1
        """Elements of every collective: the widest module's mean and variance, and a count."""
        self.forwards = self.backwards = 0
        self.device = next(itertools.chain(model.parameters(), model.buffers()), torch.zeros(0)).device
        """Where the model is (built and moved before this): the collectives' tensors."""
        self.anchor = torch.zeros(0, requires_grad=True)
        """In every module's graph, so that its backward runs (and collects) on every rank alike."""
        for module in self.modules:
            module.forward = lambda x, module=module: self._forward(module, x)
        group.side = True

    def begin_step(self) -> None:
        self.forwards = self.backwards = 0

    def complete_step(self) -> None:
        """Make the collectives of this step's forwards and backwards that this rank did not
        (its forward failed, or its slice is empty), with nothing in them."""
        expected = len(self.modules)
        if self.forwards > expected:
            raise TaskError(f"--batch-stats global: the model's {expected} batch-norm modules ran "
                            f"{self.forwards} times in one step; under --batch-stats global each runs once per "
                            "forward: call each once, or use --batch-stats local")
        try:
            for _ in range(expected - self.forwards):
                self.group.side_all_reduce(torch.zeros(self.group.world_size, self.width, device=self.device))
            for _ in range(expected - self.backwards):
                self.group.side_all_reduce(torch.zeros(self.width, device=self.device))
        except Exception:  # the group failed: the step's reduction says so
            pass
        self.forwards = self.backwards = expected

    def _forward(self, module: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
        if not module.training and module.track_running_stats:  # the running statistics: nothing to share
            return type(module).forward(module, x)
        module._check_input_dim(x)
        return _GlobalNorm.apply(x, module.weight, module.bias, self.anchor.to(x.device), module, self)


class _GlobalNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, anchor, module: _BatchNorm, stats: GlobalBatchStats):
        group, channels = stats.group, x.shape[1]
        dims = [0, *range(2, x.dim())]
        xf = x.float()
        local = xf.numel() // channels
        row = torch.zeros(stats.width, device=x.device)
        if local:
            row[:channels] = xf.mean(dims)
            row[channels:2 * channels] = xf.var(dims, unbiased=False)
        row[-1] = local
        table = torch.zeros(group.world_size, stats.width, device=x.device)
        table[group.rank] = row
        stats.forwards += 1
        group.side_all_reduce(table)
        table = table.double()
        counts = table[:, -1:]
        n = float(counts.sum())
        if n < 2:
            raise TaskError(f"--batch-stats global: a batch-norm module saw {int(n)} value per channel in the "
                            "global batch; it needs at least 2")
        means, variances = table[:, :channels], table[:, channels:2 * channels]
        mean = (counts * means).sum(0) / n
        var = (counts * (variances + (means - mean) ** 2)).sum(0) / n
        mean, var = mean.float(), var.float()
        if module.training and module.track_running_stats:
            with torch.no_grad():
                module.num_batches_tracked.add_(1)
                factor = (module.momentum if module.momentum is not None
                          else 1.0 / float(module.num_batches_tracked))
                module.running_mean.mul_(1 - factor).add_(mean.to(module.running_mean.dtype), alpha=factor)
                module.running_var.mul_(1 - factor).add_((var * (n / (n - 1))).to(module.running_var.dtype),
                                                         alpha=factor)
        shape = [1, channels] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + module.eps)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.float().view(shape) + bias.float().view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.stats, ctx.n, ctx.dims, ctx.shape, ctx.has_bias = stats, n, dims, shape, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, weight = ctx.saved_tensors
        stats, n, dims, shape = ctx.stats, ctx.n, ctx.dims, ctx.shape
        channels = xhat.shape[1]
        dyf = dy.float()
        sum_dy, sum_dy_xhat = dyf.sum(dims), (dyf * xhat).sum(dims)
        shared = torch.zeros(stats.width, device=dy.device)
        shared[:channels], shared[channels:2 * channels] = sum_dy, sum_dy_xhat
        stats.backwards += 1
        stats.group.side_all_reduce(shared)
        scale = invstd if weight is None else invstd * weight.float()
        dx = scale.view(shape) * (dyf - (shared[:channels] / n).view(shape)
                                  - xhat * (shared[channels:2 * channels] / n).view(shape))
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx.to(dy.dtype), grad_weight, grad_bias, None, None, None
