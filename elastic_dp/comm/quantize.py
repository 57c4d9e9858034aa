"""Blockwise-scaled integer quantization, and an all-reduce that sends it (``--outer-reduce
int8|int4``: DiLoCo's pseudo-gradient; docs/compression.md).

A tensor is cut into blocks of ``BLOCK`` elements, each sent as signed integers of ``bits``
bits (int8: ±127, int4: ±7, two to a byte) times its own fp32 scale, the block's largest
magnitude over the largest integer (``quantize``, ``dequantize``); a block of zeros is sent as
zeros.

``QuantizedAllReduce`` sums such tensors over the ranks in two phases, each sending the
quantized form, so that about 2(N-1)/N of the quantized bytes leave each rank, as a ring
all-reduce's do of the fp32 ones:

1. Each rank adds its error to its tensor (``y = x + e``), cuts ``y`` into N equal chunks
   (padded to whole blocks), quantizes them, keeps what the quantization missed as its next
   error (``e = y - deq(q(y))``), and sends chunk ``j`` to rank ``j`` (an all-to-all).
2. Rank ``j`` dequantizes the N chunks it received and sums them in rank order, quantizes
   the sum, adds what that missed to its own error on its chunk, and every rank receives
   every rank's quantized sum (an all-gather): the result, the same on every rank.

Quantization is not linear: each rank's error matters, not only their sum, so a run's
parameters depend on its membership history (DiLoCo's already do, through the members'
slices). Each rank's error is the reduction's state (``Reduction.state``): saved and
restored with the step, in checkpoints as one row a rank.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_dp.comm.feedback import ErrorFeedback
from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reductions import Reduction, ReductionThread, piece_bounds, reduce_in_hosts

BLOCK = 128
"""Elements that share one fp32 scale (3% more bytes at int8, 6% at int4)."""

BITS = {"int8": 8, "int4": 4}
"""The integer formats, by name."""


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32, a whole number of ``BLOCK``s) as (the integers' bytes, one fp32 scale a block)."""
    top = 2 ** (bits - 1) - 1
    blocks = x.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / top
    q = torch.round(blocks / torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]).clamp_(-top, top)
    q = q.to(torch.int8).view(-1)
    if bits == 8:
        return q.view(torch.uint8), scales
    nibbles = (q + 8).to(torch.uint8).view(-1, 2)  # 1 .. 15
    return nibbles[:, 0] << 4 | nibbles[:, 1], scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The fp32 values ``quantize`` sent (``payload``'s integers times their block's scale)."""
    if bits == 8:
        q = payload.view(torch.int8).to(torch.float32)
    else:
        q = torch.stack([payload >> 4, payload & 15], dim=1).view(-1).to(torch.float32) - 8
    return (q.view(-1, BLOCK) * scales[:, None]).view(-1)


def wire_numel(numel: int, bits: int) -> int:
    """Bytes of ``numel`` quantized elements (whole blocks) with their scales."""
    return numel * bits // 8 + numel // BLOCK * 4


def _pack(payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.cat([payload, scales.view(torch.uint8)])


def _unpack(packed: torch.Tensor, numel: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    cut = numel * bits // 8
    return packed[:cut], packed[cut:].clone().view(torch.float32)


def quantized_all_reduce(group: CollectiveGroup, flat: torch.Tensor, error: torch.Tensor | None,
                         bits: int) -> torch.Tensor:
    """``flat`` (a rank's tensor) becomes the quantized sum over ``group``'s ranks, as the
    module docstring's two phases make it, with this rank's ``error`` (None: none yet) added
    first; returns this rank's next error."""
    n, numel = group.world_size, flat.numel()
    chunk = -(-numel // (n * BLOCK)) * BLOCK
    y = torch.zeros(n * chunk, dtype=torch.float32, device=flat.device)
    y[:numel] = flat
    if error is not None:
        y[:numel] += error
    payload, scales = quantize(y, bits)
    error = y - dequantize(payload, scales, bits)
    chunk_bytes, chunk_scales = chunk * bits // 8, chunk // BLOCK
    sent = torch.cat([_pack(payload[j * chunk_bytes:(j + 1) * chunk_bytes],
                            scales[j * chunk_scales:(j + 1) * chunk_scales]) for j in range(n)])
    size = sent.numel() // n
    received = torch.empty_like(sent)
    group.all_to_all_async(received, sent, [size] * n, [size] * n).wait()
    total = torch.zeros(chunk, dtype=torch.float32, device=flat.device)
    for i in range(n):  # in rank order, on every rank alike
        total += dequantize(*_unpack(received[i * size:(i + 1) * size], chunk, bits), bits)
    mine_payload, mine_scales = quantize(total, bits)
    mine = slice(group.rank * chunk, (group.rank + 1) * chunk)
    error[mine] += total - dequantize(mine_payload, mine_scales, bits)  # the sum's part of it: this rank's
    gathered = torch.empty(n * size, dtype=torch.uint8, device=flat.device)
    group.all_gather_async(gathered, _pack(mine_payload, mine_scales)).wait()
    result = torch.cat([dequantize(*_unpack(gathered[i * size:(i + 1) * size], chunk, bits), bits)
                        for i in range(n)])
    flat.copy_(result[:numel].to(flat.dtype))
    return error[:numel]


def quantized_reduce_scatter(group: CollectiveGroup, flat: torch.Tensor, error: torch.Tensor | None, bits: int,
                             out: torch.Tensor) -> torch.Tensor:
    """``out`` (this rank's chunk: ``flat`` cut into ``group.world_size`` equal chunks, ZeRO's
    cut) becomes that chunk of the quantized sum over ``group``'s ranks, with this rank's
    ``error`` (None: none yet) added first; returns this rank's next error. Phase 1 of
    ``quantized_all_reduce`` alone, each chunk padded to whole blocks of its own: the owner
    sums the chunks it receives in fp32, in rank order, and keeps the sum as it is (no
    second quantization, no all-gather)."""
    n, numel = group.world_size, flat.numel()
    size = numel // n
    padded = -(-size // BLOCK) * BLOCK
    y = torch.zeros(n, padded, dtype=torch.float32, device=flat.device)
    y[:, :size] = flat.view(n, size)
    if error is not None:
        y[:, :size] += error.view(n, size)
    payload, scales = quantize(y.view(-1), bits)
    error = (y - dequantize(payload, scales, bits).view(n, padded))[:, :size].reshape(-1)
    row_bytes, row_scales = padded * bits // 8, padded // BLOCK
    sent = torch.cat([_pack(payload[j * row_bytes:(j + 1) * row_bytes],
                            scales[j * row_scales:(j + 1) * row_scales]) for j in range(n)])
    width = sent.numel() // n
    received = torch.empty_like(sent)
    group.all_to_all_async(received, sent, [width] * n, [width] * n).wait()
    total = torch.zeros(padded, dtype=torch.float32, device=flat.device)
    for i in range(n):  # in rank order, on every rank alike
        total += dequantize(*_unpack(received[i * width:(i + 1) * width], padded, bits), bits)
    out.copy_(total[:size].to(out.dtype))
    return error


class QuantizedAllReduce(Reduction):
    """Every rank receives the sum of the ranks' tensors as quantized integers carry it, with
    each rank's quantization error fed back into its next tensor of the same launch index
    (module docstring). ``bits``: 8 or 4."""

    name = "quantized"
    sums = False  # an approximation of the sum: the vote goes on its own channel

    def __init__(self, group: CollectiveGroup, bits: int) -> None:
        super().__init__(group)
        if bits not in BITS.values():
            raise ValueError(f"bits must be one of {sorted(BITS.values())}, got {bits}")
        self.bits = bits
        self.errors: dict[int, torch.Tensor] = {}
        """This rank's error, by launch index (a fragment's, a bucket's)."""
        self._saved: dict[int, torch.Tensor] | None = None
        self._thread = ReductionThread("edp-quantized", lambda: self.group.generation)

    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        if out is not None:
            raise ValueError("the quantized all-reduce leaves its result in place: it takes no out")
        return self._thread.submit(self._reduce, index, tensor, self.group.generation)

    def _reduce(self, index: int, tensor: torch.Tensor, generation: int) -> None:
        self._check(generation)
        self.errors[index] = quantized_all_reduce(self.group, tensor.view(-1), self.errors.get(index), self.bits)

    def wire_bytes(self, tensor: torch.Tensor) -> int:
        n = self.group.world_size
        chunk = -(-tensor.numel() // (n * BLOCK)) * BLOCK
        return wire_numel(n * chunk, self.bits)

    # -- its state ------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        return {f"error/{i}": e for i, e in self.errors.items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.errors = {int(k.removeprefix("error/")): v for k, v in state.items() if k.startswith("error/")}

    def save(self) -> None:
        self._saved = dict(self.errors)  # a reduction replaces each error with a new tensor

    def restore(self) -> None:
        if self._saved is not None:
            self.errors = dict(self._saved)


class Int8Compression(ErrorFeedback):
    """``--compress int8``: each gradient bucket all-reduced as blockwise-scaled int8 in the
    two phases of ``quantized_all_reduce``, each rank's error fed back into its next
    gradient, copied to its near neighbour every step and handed over as a membership change
    asks (``feedback.ErrorFeedback``). Not linear: each member's error matters, and the
    replay contract simulates the members (docs/compression.md)."""

    name = "int8"
    thread = "edp-int8"
    bits = 8

    def __init__(self, group: CollectiveGroup) -> None:
        super().__init__(group)
        self.numels: list[int] = []

    def bind(self, buckets: list[Any]) -> None:
        self.numels = [b.padded for b in buckets]

    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        if index == 0:
            self._threaded = True  # every bucket: the vote goes on the thread after them
        return self._thread.submit(self._reduce, index, tensor, self.group.generation, out)

    def _reduce(self, index: int, tensor: torch.Tensor, generation: int, out: torch.Tensor | None = None) -> None:
        """The bucket all-reduced in place (ZeRO stage 0) or, with ``out``, reduce-scattered
        into this rank's chunk (stages 1 and 2: ``quantized_reduce_scatter``, half the bytes,
        one quantization)."""
        group = self._world(generation)
        error = self.errors.get(index)
        if out is None:
            error = quantized_all_reduce(group, tensor.view(-1), error, self.bits)
        else:
            error = quantized_reduce_scatter(group, tensor.view(-1), error, self.bits, out)
        right, left = group.mesh.near_right(group.rank), group.mesh.near_left(group.rank)
        if left != group.rank:  # the error's copy, before the vote that commits it
            copy = torch.empty_like(error)
            for work in group.exchange_async(error, right, copy, left):
                work.wait()
            self.copies[index] = copy
        self.errors[index] = error

    def wire_bytes(self, tensor: torch.Tensor) -> int:
        n = self.group.world_size
        return wire_numel(n * -(-tensor.numel() // (n * BLOCK)) * BLOCK, self.bits)

    def _numel(self, index: int) -> int:
        return self.numels[index]

    def _buckets_with_errors(self) -> list[int]:
        return list(range(len(self.numels)))



class HostsInt8(Int8Compression):
    """``--compress int8 --compress-scope hosts``: only the hop between the hosts is int8.
    A bucket is reduced in the three steps of the hierarchical all-reduce
    (``reductions.reduce_in_hosts``): summed inside each host in fp32, exactly, each piece
    all-reduced across the hosts by ``quantized_all_reduce`` among its owners (one rank a
    host), and gathered inside the host in fp32. Each rank's error is added to its gradient
    before the host's sum, so a host's error is the sum of its ranks' (their split inside the
    host does not matter); the owner of a piece keeps what that piece's quantization missed.
    On one host nothing is quantized: the all-reduce is exact."""

    name = "int8-hosts"

    def _reduce(self, index: int, tensor: torch.Tensor, generation: int, out: torch.Tensor | None = None) -> None:
        if out is not None:  # refused by the settings (SyncSettings.check)
            raise ValueError("--compress-scope hosts all-reduces: it takes no out (ZeRO stage 0 only)")
        world = self._world(generation)
        flat = tensor.view(-1)
        if len(world.mesh.host_names) == 1:  # no hop between hosts: exact
            world.all_reduce_async(flat).wait()
            return
        error = self.errors.get(index)
        if error is not None:
            flat.add_(error)
        bounds, kept = piece_bounds(self.group, flat.numel()), torch.zeros_like(flat)

        def across(i: int, group: CollectiveGroup, piece: torch.Tensor) -> None:
            kept[bounds[i]:bounds[i + 1]] = quantized_all_reduce(group, piece, None, self.bits)

        reduce_in_hosts(self.group, flat, generation, across)
        right, left = world.mesh.near_right(world.rank), world.mesh.near_left(world.rank)
        if left != world.rank:  # the error's copy (inside the host), before the vote that commits it
            copy = torch.empty_like(kept)
            for work in world.exchange_async(kept, right, copy, left):
                work.wait()
            self.copies[index] = copy
        self.errors[index] = kept
