"""ZeRO stage 1: the optimizer state (and fp32 masters) sharded, the gradients whole.

Each bucket's full gradient buffer stays, with the gradients as views into it, and is
reduce-scattered in place as backward produces it: the rank's own chunk of it then holds
the global gradient (the one this rank updates), the rest its local one. Half the bytes of
an all-reduce.
"""

from __future__ import annotations

import torch

from elastic_dp.state.base import WholeModel
from elastic_dp.state.zero.sharded import Sharded


class ShardedOptimizer(Sharded, WholeModel):
    """ZeRO stage 1 (``--zero 1``): every parameter whole on every rank."""

    def _gradients(self) -> dict:
        return {"scatter_in_place": True}

    def _gradient_buffers(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.reducer.buckets]
