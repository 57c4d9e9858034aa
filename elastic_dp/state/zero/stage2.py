"""ZeRO stage 2: the gradients sharded too.

Each bucket is reduce-scattered into the rank's gradient chunk as backward produces it;
its full buffer exists only from its launch until the reduction completes, and the
parameters' full gradients are released as soon as they are copied in.
"""

from __future__ import annotations

import torch

from elastic_dp.state.base import WholeModel
from elastic_dp.state.zero.sharded import Sharded


class ShardedGradients(Sharded, WholeModel):
    """ZeRO stage 2 (``--zero 2``): every parameter whole on every rank."""

    def _gradients(self) -> dict:
        self.grad_chunks = [torch.zeros(c, dtype=b.dtype, device=b.params[0].device)
                            for b, c in zip(self.buckets, self.chunks)]
        return {"scatter_into": self.grad_chunks}

    def _gradient_buffers(self) -> list[torch.Tensor]:
        return self.grad_chunks
