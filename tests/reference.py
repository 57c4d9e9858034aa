"""Trusted references: plain single-process PyTorch replaying the sampler's batches.

Written independently of elastic_dp's worker: one full-batch forward per step, no
micro-batches, no collectives; a step whose loss or gradient is not finite makes no
update, as documented. Only the sampler (whose rule is documented in
elastic_dp.data) and the learning-rate rule of TrainConfig are shared.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file

from elastic_dp import ElasticSampler, Task, TrainConfig


def _to(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def replay(task: Task, config: TrainConfig, initial: str, *, steps: int | None = None,
           device: str = "cpu", lr_factor=None, scheduler=None) -> dict[str, torch.Tensor]:
    """Train from the weights in ``initial`` on ``device`` and return the final state dict
    (on the CPU). ``lr_factor(step)``: the factor on the base rates (default: the
    configuration's, ``TrainConfig.lr_factor``); ``scheduler(optimizer)``: a torch
    scheduler stepped after each step instead (what a plain loop does)."""
    torch.manual_seed(config.seed)
    model = task.model().to(device)
    model.load_state_dict(load_file(initial))
    dataset = task.dataset()
    optimizer = task.optimizer(model)
    base = [g["lr"] for g in optimizer.param_groups]
    sampler = ElasticSampler(len(dataset), global_batch=config.global_batch, seed=config.seed)
    schedule = scheduler(optimizer) if scheduler is not None else None
    lr_factor = lr_factor or config.lr_factor
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=config.precision == "bf16")
    compressor = PowerSGDContract(model, config) if config.buckets.compressor is not None else None
    for step in range(config.steps if steps is None else steps):
        batch = _to(task.collate([dataset[int(i)] for i in sampler.batch(step)]), torch.device(device))
        optimizer.zero_grad()
        with autocast:
            loss = task.loss(model, batch)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = torch.isfinite(loss) and all(bool(torch.isfinite(g).all()) for g in grads)
        if finite:  # a step with a non-finite loss or gradient is a no-op (docs/sync.md)
            if compressor is not None:
                compressor.apply()
            if config.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
            if schedule is None:
                for group, lr in zip(optimizer.param_groups, base):
                    group["lr"] = lr * lr_factor(step)
            optimizer.step()
        if schedule is not None:
            schedule.step()  # a skipped step is still a step of the run
    return {k: v.cpu() for k, v in model.state_dict().items()}


class PowerSGDContract:
    """The replay contract of ``--compress powersgd`` (docs/compression.md), written from
    the documentation: PowerSGD applied to the global gradient with one error buffer, a
    bucket at a time. The buckets are the run's partition of the parameters
    (``make_buckets``: the model's parameters last first, by size; it does not depend on
    the world size). In a bucket, each tensor of two or more dimensions viewed as
    ``(shape[0], -1)`` whose elements are more than ``min_ratio`` times its rank-``r``
    factors' is compressed: ``M = G + E``, ``P = M Q``, ``P`` orthonormalised, ``Q = Mᵀ P``,
    the gradient becomes ``P Qᵀ`` and ``E = M - P Qᵀ``; the other tensors keep their
    gradient. ``Q`` is drawn at the bucket's first compressed step (a ``RandomState(seed)``
    draw a bucket seeds ``torch.randn`` for each matrix, grouped by shape in order of
    appearance) and warm-started after; every ``Q`` is orthonormalised before use
    (Gram-Schmidt up to rank 2, QR above). The first ``start`` applied steps are not
    compressed."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig) -> None:
        from elastic_dp.comm.reducer import make_buckets  # the documented partition, as the sampler's rule

        self.spec, buckets = config.buckets.compressor, config.buckets
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [b.params for b in make_buckets(params, buckets.bucket_bytes, buckets.reduce_fp32,
                                                         first_bucket_bytes=buckets.first_bucket_bytes("cpu"))]
        self.rng = np.random.RandomState(config.seed)
        self.applied = 0
        self.errors: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, tensor) -> E
        self.qs: dict[tuple[int, int], torch.Tensor] = {}
        self.drawn: set[int] = set()

    def apply(self) -> None:
        """Replace the gradients (after a backward of the whole global batch) by the contract's."""
        if self.applied >= self.spec.start:
            for b, params in enumerate(self.buckets):
                self._bucket(b, params)
        self.applied += 1

    def _bucket(self, b: int, params: list[torch.nn.Parameter]) -> None:
        first = b not in self.drawn  # every bucket draws once, with or without a matrix to compress
        generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000))) if first else None
        self.drawn.add(b)
        compressed: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            n = p.shape[0] if p.dim() else 1
            m, r = p.numel() // n, min(p.shape[0] if p.dim() else 1, p.numel() // n, self.spec.rank)
            if p.dim() >= 2 and (n + m) * r * self.spec.min_ratio < n * m:
                compressed.setdefault((n, m, r), []).append(i)
        for (n, m, r), members in compressed.items():
            for i in members:
                p = params[i]
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                matrix = grad.detach().float().reshape(n, m) + self.errors.get((b, i), torch.zeros(n, m))
                q = self.qs[b, i] if not first else torch.randn(m, r, generator=generator)
                q = _orthonormal(q.clone())
                pm = _orthonormal(matrix @ q)
                q_next = matrix.t() @ pm
                approx = pm @ q_next.t()
                # a zero M (nobody used it, no error) gives a zero update and keeps its Q
                self.errors[b, i], self.qs[b, i] = matrix - approx, q_next if q_next.abs().sum() > 0 else q
                if p.grad is not None:
                    p.grad.copy_(approx.reshape(p.shape))


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """The columns made orthonormal in turn; a column of zeros stays zero."""
    if matrix.shape[1] > 2:
        return torch.linalg.qr(matrix)[0]
    for i in range(matrix.shape[1]):
        norm = matrix[:, i].norm()
        if norm > 0:
            matrix[:, i] /= norm
        for j in range(i + 1, matrix.shape[1]):
            matrix[:, j] -= (matrix[:, i] * matrix[:, j]).sum() * matrix[:, i]
    return matrix


RECORD_DIFFS = "EDP_RECORD_DIFFS"
"""A file to which every ``max_abs_diff`` appends its figure and the test that asked
(``python -m tests.noise FILE`` sums them up): how the suite's bounds were measured."""


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of two weight sets; NaN where either holds a NaN (a
    comparison with NaN is always false, so no bound passes it: Python's ``max`` would skip it)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    diffs = [float((a[k].float() - b[k].float()).abs().max()) for k in a]
    diff = float("nan") if any(math.isnan(d) for d in diffs) else max(diffs)
    if os.environ.get(RECORD_DIFFS):  # the test's id reaches the scenario scripts through the environment
        test = os.environ.get("PYTEST_CURRENT_TEST", " ".join(sys.argv)).rsplit(" (", 1)[0]
        caller = sys._getframe(1)
        at = f"{os.path.relpath(caller.f_code.co_filename)}:{caller.f_lineno}"
        with open(os.environ[RECORD_DIFFS], "a") as f:
            f.write(json.dumps({"test": test, "at": at, "diff": diff}) + "\n")
    return diff


def replay_updates(task: Task, config: TrainConfig, initial: str, updates: list[dict]) -> dict[str, torch.Tensor]:
    """``--mode async``'s replay contract: from the weights in ``initial``, each update's
    gradient recomputed on the parameters of its ``base_version`` (the whole global batch
    of its ``step``, clipped by its own norm), applied in ``version`` order with the base
    learning rates times its ``lr_scale``; a later line with the same version replaces an
    earlier one. The buffers (BatchNorm's statistics): each applied update adds what its
    forward changed in the buffers of its ``base_version``. Returns the final state dict."""
    torch.manual_seed(config.seed)
    model, scratch = task.model(), task.model()
    model.load_state_dict(load_file(initial))
    dataset = task.dataset()
    optimizer = task.optimizer(model)
    base = [g["lr"] for g in optimizer.param_groups]
    sampler = ElasticSampler(len(dataset), global_batch=config.global_batch, seed=config.seed)
    by_version = {u["version"]: u for u in updates}  # the last line of a version counts
    history = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    buffers = {n: b for n, b in model.named_buffers() if n in history[0] and b.dtype != torch.bool}
    scratch_buffers = dict(scratch.named_buffers())
    for version in range(1, max(by_version, default=0) + 1):
        u = by_version[version]
        scratch.load_state_dict(history[u["base_version"]])
        scratch.zero_grad()
        batch = task.collate([dataset[int(i)] for i in sampler.batch(u["step"])])
        loss = task.loss(scratch, batch)
        loss.backward()
        grads = [p.grad for p in scratch.parameters() if p.grad is not None]
        if torch.isfinite(loss) and all(bool(torch.isfinite(g).all()) for g in grads):
            if config.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(scratch.parameters(), config.clip_grad_norm)
            for p, q in zip(model.parameters(), scratch.parameters()):
                p.grad = None if q.grad is None else q.grad.clone()
            for group, lr in zip(optimizer.param_groups, base):
                group["lr"] = lr * u["lr_scale"]
            optimizer.step()
            with torch.no_grad():
                for name, buffer in buffers.items():
                    buffer.copy_(buffer + (scratch_buffers[name] - history[u["base_version"]][name]))
        history[version] = {k: v.clone() for k, v in model.state_dict().items()}
    return model.state_dict()


def replay_diloco(task: Task, config: TrainConfig, initial: dict[str, torch.Tensor], *, world: int, sync_every: int,
                  outer_lr: float, outer_momentum: float, nesterov: bool = True, steps: int | None = None,
                  changes: list[tuple[int, list[int], int]] = (), fragments: int = 1,
                  delay: int = 0,
                  outer_reduce: str = "fp32") -> tuple[dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """DiLoCo's replay contract (docs/diloco.md) in one process, the ``world`` replicas
    simulated one after another: each its own model and its own inner optimizer (the
    task's, kept across outer steps), its contiguous slice of each sampler step (as
    ``np.array_split``), its own mean loss, its own clipping, the base rates times the
    configuration's factor of the sampler step. The parameters, in order, are cut into
    ``fragments`` runs by size (a parameter belongs where its middle element falls); in each
    window of ``sync_every`` inner steps fragment f's Δ = Σ (n_k / B)(θ_f − θ_k,f) is taken
    after inner step ⌊(f+1)·H/F⌋ − ``delay`` and used ``delay`` steps later: torch's SGD
    steps θ_f with it as its gradient, and each replica's fragment becomes θ_f plus what it
    trained since the send. After the run's last step every fragment not taken at that step
    is synced once more (no delay). ``changes``: (outer boundary, lost ranks, joiners) of a
    run's membership, in order: from that boundary on the lost replicas are gone (the
    others keep their rank order, parameters and inner optimizers) and the joiners come
    last, each starting from θ with a fresh inner optimizer. ``outer_reduce`` int8 or int4:
    Δ is the quantized sum (``quantized_sum``) of the replicas' terms, each replica's error
    of each fragment carried to its next one (a lost replica's goes with it, a joiner has
    none). Returns θ's final state dict and θ after each outer step (of a fragment)."""
    import collections
    from fractions import Fraction

    import numpy as np

    steps = config.steps if steps is None else steps
    dataset = task.dataset()
    sampler = ElasticSampler(len(dataset), global_batch=config.global_batch, seed=config.seed)
    first = task.model()
    first.load_state_dict(initial)
    theta = [torch.nn.Parameter(p.detach().clone().float()) for p in first.parameters()]
    outer = torch.optim.SGD(theta, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0)

    def fresh():  # a replica starting from θ
        model = task.model()
        model.load_state_dict(initial)
        with torch.no_grad():
            for p, t in zip(model.parameters(), theta):
                p.copy_(t)
        return model, task.optimizer(model)

    total, before, fragment_of = sum(t.numel() for t in theta), 0, []
    for t in theta:
        fragment_of.append(min(fragments - 1, int(fragments * (before + Fraction(t.numel(), 2)) / total)))
        before += t.numel()
    members = [[i for i, f in enumerate(fragment_of) if f == g] for g in range(fragments)]
    sends = {(f + 1) * sync_every // fragments - delay: f for f in range(fragments)}
    uses = {(f + 1) * sync_every // fragments: f for f in range(fragments)}

    replicas = [fresh() for _ in range(world)]
    errors_of = collections.defaultdict(dict)  # id(replica) -> fragment -> its quantization error
    pending = list(changes)
    base = [g["lr"] for g in replicas[0][1].param_groups]
    history = []

    def send(f, sizes):
        params = [list(model.parameters()) for model, _ in replicas]
        if outer_reduce in ("int8", "int4"):
            terms = [torch.cat([(n / config.global_batch * (theta[i].detach() - ps[i].detach().float())).reshape(-1)
                                for i in members[f]]) for ps, n in zip(params, sizes)]
            errors = [errors_of[id(r)].get(f) for r in replicas]
            total, errors = quantized_sum(terms, errors, 8 if outer_reduce == "int8" else 4)
            for r, e in zip(replicas, errors):
                errors_of[id(r)][f] = e
            delta, at = {}, 0
            for i in members[f]:
                delta[i] = total[at:at + theta[i].numel()].view_as(theta[i])
                at += theta[i].numel()
        else:
            delta = {i: sum(n / config.global_batch * (theta[i].detach() - ps[i].detach().float())
                            for ps, n in zip(params, sizes)) for i in members[f]}
        snapshot = [{i: ps[i].detach().clone() for i in members[f]} for ps in params]
        return f, delta, snapshot

    @torch.no_grad()
    def use(flight):
        f, delta, snapshot = flight
        for i in members[f]:
            theta[i].grad = delta[i]
        outer.step()
        for (model, _), kept in zip(replicas, snapshot):
            ps = list(model.parameters())
            for i in members[f]:
                ps[i].copy_(theta[i] + (ps[i] - kept[i]) if delay else theta[i])
        for i in members[f]:
            theta[i].grad = None
        history.append([t.detach().clone() for t in theta])

    for start in range(0, steps, sync_every):
        while pending and pending[0][0] <= start:
            _, lost, joined = pending.pop(0)
            replicas = [r for i, r in enumerate(replicas) if i not in lost] + [fresh() for _ in range(joined)]
        world = len(replicas)
        stop, flight, sizes = min(start + sync_every, steps), None, []
        for done, step in enumerate(range(start, stop), start=1):
            slices = np.array_split(sampler.batch(step), world)
            sizes = [len(s) for s in slices]
            for (model, optimizer), mine in zip(replicas, slices):
                if not len(mine):
                    continue
                optimizer.zero_grad()
                task.loss(model, task.collate([dataset[int(i)] for i in mine])).backward()
                if config.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
                for group, lr in zip(optimizer.param_groups, base):
                    group["lr"] = lr * config.lr_factor(step)
                optimizer.step()
            if done in sends:
                flight = send(sends[done], sizes)
            if done in uses:
                use(flight)
                flight = None
        if flight is not None:
            use(flight)
        if stop == steps:
            for f in range(fragments):
                if (f + 1) * sync_every // fragments - delay != stop - start:
                    use(send(f, sizes))
    final = replicas[0][0]
    with torch.no_grad():
        for p, t in zip(final.parameters(), theta):
            p.copy_(t)
    return {k: v.detach().clone() for k, v in final.state_dict().items()}, history


QUANTIZED_BLOCK = 128
"""docs/diloco.md: 128 elements share a scale."""


def _quantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What the integers carry of ``x`` (whole blocks), written from docs/diloco.md: each
    block's scale is its largest magnitude over the largest integer (127, 7), each element
    rounded (half to even) to a multiple of it, a block of zeros zeros."""
    top = 2 ** (bits - 1) - 1
    out = torch.empty_like(x)
    for b in range(0, x.numel(), QUANTIZED_BLOCK):
        block = x[b:b + QUANTIZED_BLOCK]
        scale = float(block.abs().max()) / top
        out[b:b + QUANTIZED_BLOCK] = torch.round(block / scale).clamp(-top, top) * scale if scale else 0.0
    return out


def quantized_sum(terms: list[torch.Tensor], errors: list[torch.Tensor | None],
                  bits: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The quantized all-reduce of ``terms`` (one a member, in rank order) with each member's
    ``errors`` (None: none yet), written from docs/diloco.md: each member's term plus its
    error, padded to N equal chunks of whole blocks, is quantized, and what that missed is
    its next error; chunk j of the sum (the members' quantized chunks added in rank order) is
    quantized again by member j, which adds what that missed to its error there. Returns the
    sum (every member's) and the members' errors."""
    n, numel = len(terms), terms[0].numel()
    chunk = -(-numel // (n * QUANTIZED_BLOCK)) * QUANTIZED_BLOCK
    padded = []
    for term, error in zip(terms, errors):
        y = torch.zeros(n * chunk)
        y[:numel] = term + (error if error is not None else 0.0)
        padded.append(y)
    sent = [_quantized(y, bits) for y in padded]
    new = [y - q for y, q in zip(padded, sent)]
    result = torch.zeros(n * chunk)
    for j in range(n):
        part = slice(j * chunk, (j + 1) * chunk)
        total = torch.zeros(chunk)
        for q in sent:
            total += q[part]
        result[part] = _quantized(total, bits)
        new[j][part] += total - result[part]
    return result[:numel], [e[:numel] for e in new]



def quantized_scatter_sum(terms: list[torch.Tensor], errors: list[torch.Tensor | None],
                          bits: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The quantized reduce-scatter of ``terms`` (one a member, in rank order, each a bucket
    padded to a multiple of the members), written from docs/compression.md (ZeRO stages 1 and
    2): each member's term plus its error is cut into N equal chunks, each padded to whole
    blocks and quantized, and what that missed is its next error; chunk j of the result is
    the members' quantized chunks j added in rank order, not quantized again. Returns the
    result (its chunk j is member j's) and the members' errors."""
    n, numel = len(terms), terms[0].numel()
    size = numel // n
    padded = -(-size // QUANTIZED_BLOCK) * QUANTIZED_BLOCK
    sent, new = [], []
    for term, error in zip(terms, errors):
        y = torch.zeros(n, padded)
        y[:, :size] = (term + (error if error is not None else 0.0)).view(n, size)
        q = _quantized(y.view(-1), bits).view(n, padded)
        sent.append(q)
        new.append((y - q)[:, :size].reshape(-1))
    result = torch.zeros(n, padded)
    for q in sent:
        result += q
    return result[:, :size].reshape(-1), new


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(length - t.numel())])


def replay_members(task: Task, config: TrainConfig, initial: str, *, world: int,
                   changes: list[tuple[int, list[int], int]] = (), take_over: bool = True) -> dict[str, torch.Tensor]:
    """The replay contract of ``--compress int8`` (docs/compression.md), whose result depends on
    each member: the ``world`` members simulated one after another, each computing its share
    of each step's gradient on its contiguous slice (the task's loss times its samples over
    the global batch, as the sync mode scales it), the buckets (the run's partition,
    ``make_buckets``) summed by ``quantized_sum`` with each member's error, in rank order
    (ZeRO stages 1 and 2: ``quantized_scatter_sum``, ZeRO's buckets padded to the members);
    then one model clipped and stepped, a parameter no member gave a gradient left alone.
    ``changes``: (step, lost ranks, joiners) before that step, in order: a lost member's error
    is added to the error of the next rank (cyclically) of the generation it was lost from,
    the survivors keep their order, and a joiner takes a lost rank's index (the first free
    one), else comes last, with no error. ``take_over=False``: a lost member's error is
    dropped instead (what the contract forbids: for a test to show the difference)."""
    from elastic_dp.comm.reducer import make_buckets

    dataset = task.dataset()
    model = task.model()
    model.load_state_dict(load_file(initial))
    optimizer = task.optimizer(model)
    base = [g["lr"] for g in optimizer.param_groups]
    sampler = ElasticSampler(len(dataset), global_batch=config.global_batch, seed=config.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    sharded = config.stage.number in (1, 2)  # ZeRO's buckets (one param group each), reduce-scattered
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]} if sharded else None
    buckets = [b.params for b in make_buckets(params, config.buckets.bucket_bytes, config.buckets.reduce_fp32,
                                              first_bucket_bytes=config.buckets.first_bucket_bytes("cpu"),
                                              group_of=group_of)]
    members: list[dict[int, torch.Tensor]] = [{} for _ in range(world)]  # each member's error, by bucket
    pending = list(changes)
    for step in range(config.steps):
        while pending and pending[0][0] <= step:
            _, lost, joined = pending.pop(0)
            n = len(members)
            for r in sorted(lost) if take_over else ():
                keeper = next((r + k) % n for k in range(1, n) if (r + k) % n not in lost)
                for b, e in members[r].items():
                    members[keeper][b] = members[keeper][b] + e if b in members[keeper] else e
            kept = [m if r not in lost else None for r, m in enumerate(members)]
            for _ in range(joined):
                free = next((r for r, m in enumerate(kept) if m is None), None)
                if free is None:
                    kept.append({})
                else:
                    kept[free] = {}
            members = [m for m in kept if m is not None]
        indices = sampler.batch(step)
        slices = np.array_split(indices, len(members))
        sums: list[list[torch.Tensor]] = []  # per member, per bucket: its share of the gradient
        used = set()
        for mine in slices:
            optimizer.zero_grad()
            if len(mine):
                loss = task.loss(model, task.collate([dataset[int(i)] for i in mine]))
                (loss.reshape(()) * (len(mine) / config.global_batch)).backward()
            used |= {id(p) for p in params if p.grad is not None}
            sums.append([torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float()
                                    .reshape(-1) for p in bucket]) for bucket in buckets])
        for b, bucket in enumerate(buckets):
            if sharded:  # padded to a multiple of the members: the padding's error is zero
                numel = sums[0][b].numel()
                length = -(-numel // len(members)) * len(members)
                total, errors = quantized_scatter_sum([_padded(s[b], length) for s in sums],
                                                      [_padded(m[b], length) if b in m else None for m in members], 8)
                total, errors = total[:numel], [e[:numel] for e in errors]
            else:
                total, errors = quantized_sum([s[b] for s in sums], [m.get(b) for m in members], 8)
            for m, e in zip(members, errors):
                m[b] = e
            at = 0
            for p in bucket:
                p.grad = total[at:at + p.numel()].view_as(p).to(p.dtype).clone() if id(p) in used else None
                at += p.numel()
        if config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * config.lr_factor(step)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def replay_hosts(task: Task, config: TrainConfig, initial: str, *, hosts: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The replay contract of ``--compress int8 --compress-scope hosts`` (docs/compression.md)
    for ranks on ``hosts`` (one name a rank, in rank order): each rank's share of a step's
    gradient on its slice, as ``replay_members``; each bucket (the run's partition) cut into
    the hierarchical all-reduce's pieces (``comm.mesh.Mesh``: one a rank of the largest
    host, owned in contiguous blocks by a host's ranks); a host's error at a piece added to
    its owner's share, the host's shares summed in rank order in fp32; each piece's host
    sums added by ``quantized_sum`` across the hosts (in the order of their first rank), each
    host keeping what its sum's quantization missed. One host: the exact sum."""
    from elastic_dp.comm.mesh import Mesh
    from elastic_dp.comm.reducer import make_buckets

    mesh = Mesh(tuple(hosts))
    names = list(dict.fromkeys(hosts))
    dataset = task.dataset()
    model = task.model()
    model.load_state_dict(load_file(initial))
    optimizer = task.optimizer(model)
    base = [g["lr"] for g in optimizer.param_groups]
    sampler = ElasticSampler(len(dataset), global_batch=config.global_batch, seed=config.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = [b.params for b in make_buckets(params, config.buckets.bucket_bytes, config.buckets.reduce_fp32,
                                              first_bucket_bytes=config.buckets.first_bucket_bytes("cpu"))]
    errors: dict[tuple[str, int], torch.Tensor] = {}  # (host, bucket) -> the host's error
    for step in range(config.steps):
        slices = np.array_split(sampler.batch(step), len(hosts))
        shares, used = [], set()
        for mine in slices:
            optimizer.zero_grad()
            if len(mine):
                loss = task.loss(model, task.collate([dataset[int(i)] for i in mine]))
                (loss.reshape(()) * (len(mine) / config.global_batch)).backward()
            used |= {id(p) for p in params if p.grad is not None}
            shares.append([torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float()
                                      .reshape(-1) for p in bucket]) for bucket in buckets])
        for b, bucket in enumerate(buckets):
            numel = shares[0][b].numel()
            if len(names) == 1:
                total = torch.zeros(numel)
                for share in shares:
                    total += share[b]
            else:
                bounds = [i * numel // mesh.pieces for i in range(mesh.pieces + 1)]
                sums = {}
                for h in names:
                    mine = [share[b].clone() for r, share in enumerate(shares) if hosts[r] == h]
                    error = errors.get((h, b))
                    if error is not None:  # each piece's error is its owner's to add
                        ranks = mesh.on_host(h)
                        for i in range(mesh.pieces):
                            owner = ranks.index(mesh.owner(h, i))
                            mine[owner][bounds[i]:bounds[i + 1]] += error[bounds[i]:bounds[i + 1]]
                    sums[h] = torch.zeros(numel)
                    for term in mine:
                        sums[h] += term
                total, new = torch.zeros(numel), {h: torch.zeros(numel) for h in names}
                for i in range(mesh.pieces):
                    part = slice(bounds[i], bounds[i + 1])
                    if bounds[i + 1] == bounds[i]:
                        continue
                    result, piece_errors = quantized_sum([sums[h][part] for h in names], [None] * len(names), 8)
                    total[part] = result
                    for h, e in zip(names, piece_errors):
                        new[h][part] = e
                errors.update({(h, b): e for h, e in new.items()})
            at = 0
            for p in bucket:
                p.grad = total[at:at + p.numel()].view_as(p).to(p.dtype).clone() if id(p) in used else None
                at += p.numel()
        if config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * config.lr_factor(step)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
