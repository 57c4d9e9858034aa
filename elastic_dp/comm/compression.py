"""Compressed gradient reductions (``--compress``): fewer bytes on the wire than the sum.

``PowerSGD`` (arXiv 1905.13727, as torch's ``powerSGD_hook`` does it for DDP) reduces each
gradient matrix of a bucket to a low-rank approximation of the sum over the ranks, with
error feedback; the other tensors of the bucket (vectors, and matrices too small for the
rank to pay: ``min_ratio``) are all-reduced as they are. Its state (each rank's error, the
warm-started factors ``Q``, the count of steps) is the reduction's, declared as
``comm.reductions.Reduction`` says: saved and restored with the step, in checkpoints as
one row a rank, agreed on by a new generation.

The replay contract (docs/compression.md), which ``tests/reference.py`` follows: PowerSGD
applied to the global gradient ``G`` (the sum over the ranks) with one error buffer ``E``:
for each matrix ``M = G + E`` of a bucket (viewed as ``(shape[0], -1)``), ``P = M Q``, ``P``
orthonormalised, ``Q = Mᵀ P``, the update ``P Qᵀ`` and ``E = M - P Qᵀ``. Each rank ``k``
computes ``P`` and ``Q`` of its own ``M_k = G_k + E_k`` and the all-reduces sum them, which is
exact because both are linear in ``M``; it keeps ``E_k = M_k - P Qᵀ / N``, so that the
ranks' errors sum to the contract's ``E`` at any world size ``N``, whatever it was before:
only that sum matters. A joiner starts with no error; a checkpoint's rows are summed into
one rank's at a resume; a worker that fails or leaves has its error taken over by the rank
that holds its copy (every step each rank sends its ``M_k`` to its neighbour in the near
ring, ``Mesh.near_ring``, which keeps ``M_k - P Qᵀ / N``; the vote waits for the copies, so
a step commits only where every copy arrived).

The factors follow torch's hook, so that the same run under DDP with its hook reaches the
same parameters up to float order: a bucket's ``Q`` is drawn the first time the bucket is
compressed (``numpy.random.RandomState(seed).randint`` once a bucket, in launch order, seeds
``torch.randn`` for each matrix, the bucket's tensors in its order, the model's last first
as DDP's buckets hold them, grouped by shape in the order their shapes first appear) and
orthonormalised; afterwards each step starts from the last step's ``Q``, orthonormalised
again (warm start). For the first ``start`` steps the buckets are all-reduced uncompressed
and no error is kept.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from elastic_dp.comm.feedback import ErrorFeedback
from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.quantize import BLOCK, HostsInt8, Int8Compression, wire_numel
from elastic_dp.comm.reducer import make_buckets
from elastic_dp.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PowerSGDSpec:
    """``--compress powersgd:rank=R[:start=S][:min-ratio=X]``."""

    rank: int
    """The rank of each matrix's approximation."""
    start: int = 10
    """Steps all-reduced uncompressed before compression starts (torch's
    ``start_powerSGD_iter``; its default is 1,000)."""
    min_ratio: float = 2.0
    """A matrix is compressed only where its elements are more than this many times the
    factors' (torch's ``min_compression_rate``)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"--compress powersgd: rank must be >= 1, got {self.rank}")
        if self.start < 0:
            raise ConfigError(f"--compress powersgd: start must be >= 0, got {self.start}")
        if self.min_ratio < 1:
            raise ConfigError(f"--compress powersgd: min-ratio must be >= 1, got {self.min_ratio}")

    def describe(self) -> str:
        return f"powersgd:rank={self.rank}:start={self.start}:min-ratio={self.min_ratio:g}"


@dataclass(frozen=True, slots=True)
class Int8Spec:
    """``--compress int8``: each bucket all-reduced as blockwise-scaled int8 (``quantize``)."""

    def describe(self) -> str:
        return "int8"


COMPRESSORS = ("powersgd", "int8")
"""What ``--compress`` takes."""


def parse_compress(text: str | PowerSGDSpec | Int8Spec | None) -> PowerSGDSpec | Int8Spec | None:
    """``--compress``'s value: None, ``powersgd:rank=R[:start=S][:min-ratio=X]`` or ``int8``."""
    if text is None or isinstance(text, (PowerSGDSpec, Int8Spec)):
        return text
    name, *options = str(text).split(":")
    if name not in COMPRESSORS:
        raise ConfigError(f"--compress must be one of {', '.join(COMPRESSORS)} (powersgd:rank=R[:start=S]"
                          f"[:min-ratio=X], int8), got {text!r}")
    if name == "int8":
        if options:
            raise ConfigError(f"--compress int8 takes no options, got {text!r}")
        return Int8Spec()
    fields: dict[str, Any] = {}
    kinds = {"rank": ("rank", int), "start": ("start", int), "min-ratio": ("min_ratio", float)}
    for option in options:
        key, _, value = option.partition("=")
        if key not in kinds or not value:
            raise ConfigError(f"--compress powersgd takes rank=R, start=S and min-ratio=X, got {option!r} in {text!r}")
        field, kind = kinds[key]
        try:
            fields[field] = kind(value)
        except ValueError:
            raise ConfigError(f"--compress powersgd: {key} must be a number, got {value!r} in {text!r}") from None
    if "rank" not in fields:
        raise ConfigError(f"--compress powersgd needs rank=R (powersgd:rank=2), got {text!r}")
    return PowerSGDSpec(**fields)


@dataclass(slots=True)
class _Plan:
    """What one bucket's reduction does with its tensors (``PowerSGD.bind``)."""

    matrices: list[tuple[int, int, int, int]]
    """Each compressed tensor, in the order its factors are drawn: (offset in the bucket,
    rows, columns, rank)."""
    plain: list[tuple[int, int]]
    """Each tensor all-reduced as it is: (offset, elements)."""
    dtype: torch.dtype
    """The bucket's (its factors' too)."""
    numel: int
    """The bucket's length (its error's)."""

    @property
    def p_numel(self) -> int:
        return sum(n * r for _, n, _, r in self.matrices)

    @property
    def q_numel(self) -> int:
        return sum(m * r for _, _, m, r in self.matrices)


class PowerSGD(ErrorFeedback):
    """Low-rank compression of each gradient matrix with error feedback (module docstring);
    its errors' copies and what a membership change does to them: ``feedback.ErrorFeedback``."""

    name = "powersgd"
    thread = "edp-powersgd"

    def __init__(self, group: CollectiveGroup, spec: PowerSGDSpec, seed: int) -> None:
        super().__init__(group)
        self.spec, self.seed = spec, seed
        self.plans: list[_Plan] = []
        self.iter = 0
        """Steps reduced so far (compression starts at ``spec.start``)."""
        self.qs: dict[int, torch.Tensor] = {}
        """The last step's ``Q`` factors, by bucket (one flat tensor of each bucket's)."""
        self._rng = np.random.RandomState(seed)
        self._seeds: dict[int, int] = {}  # bucket -> the seed of its first factors, drawn at its launch

    def bind(self, buckets: list[Any]) -> None:
        plans = []
        for bucket in buckets:
            order = sorted(range(len(bucket.params)), key=lambda i: bucket.offsets[i])  # the bucket's: last first
            by_shape: dict[tuple, list[tuple[int, int, int, int]]] = defaultdict(list)
            plain = []
            for i in order:
                param, offset = bucket.params[i], bucket.offsets[i]
                n = param.shape[0] if param.dim() > 0 else 1
                m = param.numel() // max(n, 1)
                rank = min(n, m, self.spec.rank)
                if param.dim() >= 2 and (n + m) * rank * self.spec.min_ratio < n * m:
                    by_shape[(n, m)].append((offset, n, m, rank))
                else:
                    plain.append((offset, param.numel()))
            plans.append(_Plan([t for group in by_shape.values() for t in group], plain, bucket.dtype,
                               bucket.padded))
        self.plans = plans

    # -- the reduction ------------------------------------------------------------------------
    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        """Bucket ``index`` reduced in place (ZeRO stage 0) or, with ``out``, this rank's
        chunk of it (stages 1 and 2): the approximation is of the whole bucket on every rank
        (the factors are all-reduced whole), so the chunk is cut out of it; the tensors left
        uncompressed are all-reduced with the factors, and the steps before ``start``
        reduce-scattered as they are."""
        compress = self.iter >= self.spec.start
        if self.iter == self.spec.start:  # the first compressed step: one draw a bucket, as torch's hook
            self._seeds[index] = int(self._rng.randint(1_000_000_000))  # (with or without a matrix)
        if index == 0:
            self._threaded = False
        if index == len(self.plans) - 1:
            self.iter += 1  # the step's last bucket
        if not compress or not self.plans[index].matrices:
            if out is not None:
                return self.group.reduce_scatter_async(out, tensor)
            return self.group.all_reduce_async(tensor)
        self._threaded = True
        return self._thread.submit(self._reduce, index, tensor, self.group.generation, out)

    def _reduce(self, index: int, tensor: torch.Tensor, generation: int, out: torch.Tensor | None = None) -> None:
        self._approximate(index, tensor, generation)
        if out is not None:
            chunk = tensor.view(self.parts, -1)[self.part]
            if chunk.data_ptr() != out.data_ptr():
                out.copy_(chunk)

    def _approximate(self, index: int, tensor: torch.Tensor, generation: int) -> None:
        """``tensor`` becomes the approximation of the bucket's sum over the ranks (the module
        docstring's steps), this rank's error and its copy of its left neighbour's kept."""
        group = self._world(generation)
        world_size = group.world_size
        plan, flat = self.plans[index], tensor.view(-1)
        error = self.errors.get(index)
        if error is not None:
            flat.add_(error)
        kept = flat.clone()  # M_k = G_k + E_k, whose residual is this rank's next error
        plain = torch.cat([flat[o:o + n] for o, n in plan.plain]) if plan.plain else None
        works = [group.all_reduce_async(plain)] if plain is not None else []
        right, left = group.mesh.near_right(group.rank), group.mesh.near_left(group.rank)
        received = torch.empty_like(kept) if left != group.rank else None  # the left neighbour's M
        if received is not None:  # its residual, this rank's copy of that error, needs only the result
            works += group.exchange_async(kept, right, received, left)
        matrices = [flat[o:o + n * m].view(n, m) for o, n, m, _ in plan.matrices]
        qs = self._factors(index, plan, flat.dtype, flat.device)
        p_flat = torch.empty(plan.p_numel, dtype=flat.dtype, device=flat.device)
        ps = _split(p_flat, [(n, r) for _, n, _, r in plan.matrices])
        for matrix, q, p in zip(matrices, qs, ps):
            torch.matmul(matrix, q, out=p)
        works.append(group.all_reduce_async(p_flat))
        for work in works:
            work.wait()
        if plain is not None:  # the plain tensors' sum, into the bucket
            at = 0
            for o, n in plan.plain:
                flat[o:o + n].copy_(plain[at:at + n])
                at += n
        for p in ps:
            _orthonormalise(p)
        q_flat = torch.empty(plan.q_numel, dtype=flat.dtype, device=flat.device)
        started = qs  # this step's Q, orthonormalised
        qs = _split(q_flat, [(m, r) for _, _, m, r in plan.matrices])
        for matrix, p, q in zip(matrices, ps, qs):
            torch.matmul(matrix.t(), p, out=q)
        group.all_reduce_async(q_flat).wait()
        for matrix, p, q, before in zip(matrices, ps, qs, started):
            torch.matmul(p, q.t(), out=matrix)  # the sum's approximation, in place of M_k
            # a matrix whose M was zero on every rank (a parameter nobody used, with no error)
            # keeps its Q: a zero Q would stay zero and never pass its gradient again
            q.copy_(torch.where(q.abs().sum() > 0, q, before))
        share = 1.0 / world_size  # this rank's part of the approximation: the errors sum to the contract's
        self.errors[index] = _residual(kept, flat, plan, share)
        if received is not None:
            self.copies[index] = _residual(received, flat, plan, share)
        self.qs[index] = q_flat

    def _factors(self, index: int, plan: _Plan, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """This step's ``Q`` of each matrix of bucket ``index``: the last step's, orthonormalised
        again, or (the bucket's first compressed step) drawn as torch's hook draws them."""
        last = self.qs.get(index)
        q_flat = torch.empty(plan.q_numel, dtype=dtype, device=device)
        qs = _split(q_flat, [(m, r) for _, _, m, r in plan.matrices])
        if last is not None:
            q_flat.copy_(last)
        else:  # a generator of its own: the training thread's draws are not touched
            generator = torch.Generator().manual_seed(self._seeds.pop(index))
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=generator, dtype=dtype))
        for q in qs:
            _orthonormalise(q)
        return qs

    # -- its state beside the errors: the factors, the step count, the draws ------------------------
    def state(self) -> dict[str, torch.Tensor]:
        state = super().state()
        state.update({f"q/{b}": q for b, q in self.qs.items()})
        state["iter"] = torch.tensor([self.iter], dtype=torch.int64)
        return state

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state(state)
        self.qs = {int(k[2:]): v for k, v in state.items() if k.startswith("q/")}
        self.iter = int(state["iter"][0]) if "iter" in state else 0
        self._rng, self._seeds = np.random.RandomState(self.seed), {}
        if self.iter > self.spec.start:  # every bucket drew at the first compressed step
            for _ in self.plans:
                self._rng.randint(1_000_000_000)

    def _kept(self) -> tuple:
        return dict(self.qs), self.iter, self._rng.get_state(), dict(self._seeds)

    def _put_back(self, kept: tuple) -> None:
        qs, self.iter, rng, seeds = kept
        self.qs, self._seeds = dict(qs), dict(seeds)
        self._rng.set_state(rng)

    def holds(self) -> bool:
        return self.iter > 0

    def agree(self, source: int) -> dict[str, torch.Tensor]:
        """Rank ``source``'s step count and factors, on every rank (as ``state`` names them)."""
        group = self.group
        count = group.broadcast(torch.tensor([self.iter], dtype=torch.int64), source)
        agreed = {"iter": count}
        if int(count[0]) > self.spec.start:  # every bucket with matrices has its factors
            for b, plan in enumerate(self.plans):
                if plan.matrices:
                    q = self.qs[b].clone() if group.rank == source else torch.empty(plan.q_numel, dtype=plan.dtype)
                    agreed[f"q/{b}"] = group.broadcast(q, source)
        return agreed

    def _numel(self, index: int) -> int:
        return self.plans[index].numel

    def _buckets_with_errors(self) -> list[int]:
        return [b for b, plan in enumerate(self.plans) if plan.matrices]


def make_compressor(group: CollectiveGroup, spec: PowerSGDSpec | Int8Spec, seed: int,
                    scope: str = "all") -> ErrorFeedback:
    """The reduction ``--compress`` names (``comm.settings.Buckets.compressor``), over every
    byte or (``--compress-scope hosts``) the hop between the hosts."""
    if isinstance(spec, Int8Spec):
        return HostsInt8(group) if scope == "hosts" else Int8Compression(group)
    return PowerSGD(group, spec, seed)


def wire_bytes_per_step(params: list[torch.nn.Parameter], spec: PowerSGDSpec | Int8Spec,
                        buckets: Any) -> tuple[int, int]:
    """What ``--compress`` makes each worker move per compressed step, for ``params`` (real or
    on the meta device) in buckets as ``buckets`` (``comm.settings.Buckets``) cuts them, in
    bytes: (into the all-reduces: PowerSGD's factors and the tensors it leaves, fp32; int8's
    integers and scales; its error copied to its near neighbour, fp32)."""
    cut = make_buckets([p for p in params if p.requires_grad], buckets.bucket_bytes, buckets.reduce_fp32,
                       first_bucket_bytes=buckets.first_bucket_bytes("cpu"))
    if isinstance(spec, Int8Spec):
        return sum(wire_numel(-(-b.padded // BLOCK) * BLOCK, 8) for b in cut), 4 * sum(b.padded for b in cut)
    reduction = PowerSGD(None, spec, seed=0)
    reduction.bind(cut)
    reduced = sum(sum(n for _, n in plan.plain) + plan.p_numel + plan.q_numel for plan in reduction.plans)
    return 4 * reduced, 4 * sum(plan.numel for plan in reduction.plans if plan.matrices)


def _residual(kept: torch.Tensor, approximation: torch.Tensor, plan: _Plan, share: float) -> torch.Tensor:
    """An error of one bucket: ``kept`` (a rank's M) less ``share`` of the approximation, on
    the compressed matrices; zero on the tensors all-reduced as they are."""
    error = torch.zeros_like(kept)
    for o, n, m, _ in plan.matrices:
        error[o:o + n * m] = kept[o:o + n * m] - approximation[o:o + n * m] * share
    return error


def _split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    out, at = [], 0
    for rows, cols in shapes:
        out.append(flat[at:at + rows * cols].view(rows, cols))
        at += rows * cols
    return out


def _orthonormalise(matrix: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of ``matrix`` in place (torch's hook's, for ranks up to 2;
    it takes QR above: the same columns up to float order and sign conventions). A column of
    zeros stays zero (torch's hook makes it NaN: a parameter nobody used, with no error)."""
    if matrix.shape[1] > 2:
        q, _ = torch.linalg.qr(matrix)
        matrix.copy_(q)
        return
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        norm = torch.norm(col)
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col
