"""``elastic-dp plan``, capacity planning: per-worker memory and communication of data-parallel training.

The memory model of docs/zero.md, per parameter (Ψ parameters, N workers):

===========  =========  ============  =========================================
precision    params P   gradients G   optimizer state K (Adam; m moments)
===========  =========  ============  =========================================
bf16         2          2             4 (fp32 master) + 4·m  = 12 for Adam
fp32         4          4             4·m                    =  8 for Adam
===========  =========  ============  =========================================

per worker: stage 0: (P + G + K)Ψ; stage 1: (P + G)Ψ + KΨ/N; stage 2: PΨ + (G + K)Ψ/N;
stage 3: (P + G + K)Ψ/N. Mixed-precision Adam at stage 0 is the published 16 bytes per
parameter. Activations, temporary buffers and allocator overhead are not included.

Stage 3 adds, for a while in each step, the units it gathers (``--unit-params U``, the
largest unit's parameters): the unit computing and the next one prefetched, 2·P·U, and
the computing unit's full gradient before it is reduce-scattered, G·U; with
``--no-reshard-after-forward`` the units stay gathered from their forward to their
backward, so at the end of the forward every parameter is, PΨ.

Peer snapshots (stages 1 and 2, more than one worker): every ``--snapshot-every`` steps
each rank packs its chunk of the fp32 masters and optimizer state, S = (4 + 4·m)Ψ/N bytes
(the master is packed even where the parameters are fp32), and keeps the
``SNAPSHOTS_KEPT`` newest of its own and of its left neighbour's, in host memory:
2·SNAPSHOTS_KEPT·S per worker, or SNAPSHOTS_KEPT·S where the neighbour is on the same
host and maps the owner's copies instead. NCCL sends from the device, so while a
snapshot travels to a neighbour on another host the device holds a copy of it and the
buffer it receives into, 2·S more, for one step. Neither is in the training-state total.

Communication, bytes each worker sends per step, as elastic_dp's stages do it (ring
algorithms; the all-to-alls that run stage 1 and 2's collectives on gloo send as many),
peer snapshots apart: stage 0 all-reduces the gradients, 2(N-1)/N · GΨ; stages 1 and 2
reduce-scatter them and all-gather the updated parameters, (N-1)/N · (G + P)Ψ; stage 3
all-gathers the parameters in the forward and again in the backward and reduce-scatters
the gradients, (N-1)/N · (2P + G)Ψ (one all-gather less with ``--no-reshard-after-forward``,
and for the root unit's and the last unit's parameters, which stay gathered from their
forward to their backward: ``gathered_once``, counted by ``--job``).

Over the hosts' links (``--hosts H --workers-per-host W``, N = H·W; the ranks of a host
contiguous, docs/hosts.md), bytes each host sends per step: stage 0 with a flat ring,
2(N-1)/N · GΨ (one rank of each host sends to the next host); with the hierarchical
all-reduce, 2(H-1)/H · GΨ. Stages 1 to 3 move (G + P)Ψ, or (2P + G)Ψ at stage 3 (call it
X): on gloo their collectives are all-to-alls, in which each of a host's W ranks sends a
chunk to each of the N-W ranks elsewhere, W(H-1)/H · X; NCCL's rings send (N-1)/N · X.
With ``--shard-scope host`` (HSDP: the state cut over each host's W workers, replicated
across the hosts) the parameter all-gathers stay inside the hosts, and only each chunk's
gradient crosses, all-reduced among its H replicas: 2(H-1)/H · GΨ per host, at any stage,
as stage 0's hierarchical all-reduce; each worker then holds 1/W of the sharded state, not
1/N, and no peer snapshot.

With ``--compress`` (the model's shapes from ``--job``) a compressed step puts C bytes into
its all-reduces (PowerSGD: the factors and the tensors it leaves, fp32; int8: the integers
and their scales): 2(N-1)/N · C bytes per worker, and over each host's link as a flat ring;
each worker also copies its error, one fp32 bucket-sized tensor per bucket with a compressed
matrix, to a neighbour on its host (over the link only where it is alone on its host), and
holds its own and that copy. At ZeRO stages 1 and 2 int8 reduce-scatters instead, (N-1)/N · C
(an all-to-all on gloo: W(H-1)/H · C over a host's link), PowerSGD all-reduces its factors as
at stage 0, and the updated parameters are all-gathered, (N-1)/N · PΨ; the errors are held as
of the step before too (a re-formation may restore the chunks a committed step back): twice
stage 0's. With
``--compress int8 --compress-scope hosts`` the hop between the hosts alone is int8: each host
sends 2(H-1)/H of the quantized bytes over its link, as the hierarchical all-reduce does of
the fp32 ones.

With ``--param-dtype bf16`` (stage 3, fp32 parameters): each chunk holds the parameters in
bf16 (2 bytes) beside their fp32 masters (4), the gathers send bf16 (P = 2) and the
gradients are reduced in fp32 (G = 4): half the gathers' bytes of the fp32 run.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from elastic_dp.errors import ConfigError
from elastic_dp.state.zero.chunks import SNAPSHOTS_KEPT
from elastic_dp.state.zero.settings import STAGES

OPTIMIZER_MOMENTS = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}
PRECISIONS = {"bf16": (2, 2, 4), "fp32": (4, 4, 0)}
"""precision -> (param bytes, gradient bytes, fp32 master bytes)."""

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12,
          "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | float, flag: str) -> float:
    """``7.5e9``, ``7.5B``, ``125M``, ``80GB``, ``80GiB`` -> a positive number."""
    match = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _UNITS:
        raise ConfigError(f"{flag} expects a number such as 7.5e9, 125M or 80GB, got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{flag} must be positive, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    params: float
    workers: int
    zero: int
    precision: str = "bf16"
    optimizer: str = "adam"
    unit_params: float | None = None
    """Stage 3: the largest unit's parameters (None: not known, nothing added for them)."""
    reshard: bool = True
    """Stage 3: the units are freed after their forward (``--no-reshard-after-forward``: not)."""
    gathered_once: float = 0.0
    """Stage 3: the parameters gathered once a step, not twice: the root unit's and the last
    unit's, kept from their forward to their backward (``elastic-dp plan --job`` counts them
    from the job's model, ``units.gathered_once``; 0: every parameter counted twice, an upper bound)."""
    hosts: int | None = None
    """The hosts the workers are spread over, ``workers`` / ``hosts`` on each (None: not given)."""
    shard_scope: str = "all"
    """``--shard-scope``: the sharded state cut over every worker (``all``) or each host's (``host``)."""
    spares: int = 0
    """``--spares``: workers built beside the group, each with a device of its own that must
    hold a member's state once it is promoted."""
    param_dtype: str = "fp32"
    """Stage 3's ``--param-dtype``: bf16 gathers fp32 parameters as bf16 (2 bytes), keeps
    their fp32 masters in the chunks and reduces the gradients in fp32 (4 bytes)."""
    compress: str | None = None
    """``--compress``: the compressor (stage 0)."""
    compress_scope: str = "all"
    """``--compress-scope``: every byte of the all-reduce (``all``), or the hop between the hosts (``hosts``)."""
    compressed: tuple[int, int] | None = None
    """With ``compress``: the bytes each worker puts into its all-reduces per compressed step
    and those of its error it copies to its near neighbour (``comm.compression.wire_bytes_per_step``,
    from the model's shapes: ``elastic-dp plan --job``)."""

    def __post_init__(self) -> None:
        if not self.params > 0:
            raise ConfigError(f"--params must be positive, got {self.params}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"--workers must be a positive integer, got {self.workers}")
        if self.zero not in STAGES:
            *first, last = map(str, STAGES)
            raise ConfigError(f"--zero must be stage {', '.join(first)} or {last}, got {self.zero!r}")
        if not 0 <= self.gathered_once <= self.params:
            raise ConfigError(f"gathered_once must be between 0 and --params, got {self.gathered_once}")
        if self.unit_params is not None and not 0 < self.unit_params <= self.params:
            raise ConfigError(f"--unit-params must be positive and at most --params, got {self.unit_params}")
        if (self.unit_params is not None or not self.reshard) and "parameters" not in self._partitioned:
            raise ConfigError("--unit-params and --no-reshard-after-forward are ZeRO stage 3's: add --zero 3")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZER_MOMENTS:
            raise ConfigError(f"--optimizer must be one of {sorted(OPTIMIZER_MOMENTS)}, got {self.optimizer!r}")
        if self.hosts is not None and (self.hosts < 1 or self.workers % self.hosts):
            raise ConfigError(f"--hosts must be a positive divisor of the {self.workers} workers, got {self.hosts}")
        if not isinstance(self.spares, int) or self.spares < 0:
            raise ConfigError(f"--spares must be a non-negative integer, got {self.spares}")
        if self.shard_scope not in ("all", "host"):
            raise ConfigError(f"--shard-scope must be all or host, got {self.shard_scope!r}")
        if self.param_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--param-dtype must be fp32 or bf16, got {self.param_dtype!r}")
        if self.param_dtype == "bf16" and "parameters" not in self._partitioned:
            raise ConfigError("--param-dtype bf16 gathers ZeRO stage 3's parameters in bf16: give --zero 3")
        if self.compress is not None and "parameters" in self._partitioned:
            raise ConfigError(f"--compress keeps each worker's error of the whole gradient, which --zero {self.zero} "
                              "never holds: plan it at --zero 0, 1 or 2")
        if self.compress is not None and self.shard_scope == "host":
            raise ConfigError("--compress at ZeRO stages 1 and 2 reduce-scatters over every worker: drop "
                              "--shard-scope host")
        if self.compress_scope not in ("all", "hosts"):
            raise ConfigError(f"--compress-scope must be all or hosts, got {self.compress_scope!r}")
        if self.compress_scope == "hosts" and (self.compress != "int8" or self.hosts is None or self._partitioned):
            raise ConfigError("--compress-scope hosts compresses the hop between the hosts of ZeRO stage 0's "
                              "hierarchical all-reduce with int8: give --compress int8 and --hosts, at --zero 0")
        if self.compress is not None and self.compressed is None:
            raise ConfigError("--compress needs the model's shapes (which matrices it compresses, and to what): "
                              "give --job MODULE")
        if self.shard_scope == "host" and (self.hosts is None or not self._partitioned):
            raise ConfigError("--shard-scope host shards ZeRO's state inside each host: give --zero 1, 2 or 3 and "
                              "--hosts")

    @property
    def _partitioned(self) -> frozenset[str]:
        """What the stage partitions over the workers (``Stage.partitioned``)."""
        return STAGES[self.zero].partitioned

    # bytes per parameter, whole (unsharded)
    @property
    def _pgk(self) -> tuple[float, float, float]:
        p, g, master = PRECISIONS[self.precision]
        if self.param_dtype == "bf16" and self.precision == "fp32":  # bf16 gathers of fp32 masters
            p, g, master = 2, 4, 4
        return p, g, master + 4 * OPTIMIZER_MOMENTS[self.optimizer]

    @property
    def _shards(self) -> int:
        """Over how many workers the sharded state is cut."""
        return self.workers // self.hosts if self.shard_scope == "host" else self.workers

    def bytes_per_param(self, workers: int | None = None) -> dict[str, float]:
        """Per-worker bytes per parameter: parameters, gradients, optimizer state, total."""
        n = workers or self._shards
        p, g, k = self._pgk
        partitioned = self._partitioned
        k /= n if "optimizer" in partitioned else 1
        g /= n if "gradients" in partitioned else 1
        p /= n if "parameters" in partitioned else 1
        return {"parameters": p, "gradients": g, "optimizer_state": k, "total": p + g + k}

    def gathered_bytes(self) -> float:
        """Stage 3: the bytes of gathered units a worker holds at the busiest moment of a
        step, on top of its training state (0 at the other stages, or with no ``unit_params``)."""
        if "parameters" not in self._partitioned:
            return 0.0
        p, g, _ = self._pgk
        if not self.reshard:
            return p * self.params + g * (self.unit_params or 0.0)
        return (2 * p + g) * self.unit_params if self.unit_params else 0.0

    def per_worker_bytes(self, workers: int | None = None) -> dict[str, float]:
        return {k: v * self.params for k, v in self.bytes_per_param(workers).items()}

    def snapshot_bytes(self) -> dict[str, float]:
        """Per-worker bytes of peer snapshots: host memory with the left neighbour on
        another host, and on the same host; the device's extra while one is sent (NCCL)."""
        if not self._partitioned or self.workers == 1 or self._shards < self.workers:  # none, or replicas instead
            return {"host": 0.0, "host_neighbour_on_same_host": 0.0, "device_while_sent": 0.0}
        one = (4 + 4 * OPTIMIZER_MOMENTS[self.optimizer]) * self.params / self.workers
        return {"host": 2 * SNAPSHOTS_KEPT * one, "host_neighbour_on_same_host": SNAPSHOTS_KEPT * one,
                "device_while_sent": 2 * one}

    def workers_needed(self, gpu_memory: float, with_units: bool = False) -> int | None:
        """Fewest workers whose per-worker training state fits in ``gpu_memory`` bytes (with
        ``with_units``: and the gathered units, ``gathered_bytes``); None when no number of
        workers is enough at this stage."""
        whole = dict(zip(("parameters", "gradients", "optimizer"), self._pgk))
        fixed = sum(v for k, v in whole.items() if k not in self._partitioned)
        sharded = sum(v for k, v in whole.items() if k in self._partitioned)
        room = gpu_memory / self.params - fixed - (self.gathered_bytes() if with_units else 0.0) / self.params
        if room < 0 or (room == 0 and sharded > 0):
            return None
        return 1 if sharded == 0 else max(1, math.ceil(sharded / room - 1e-12))

    def comm_bytes_per_step(self) -> float:
        """Bytes each worker sends per step (ring algorithms; under ``--shard-scope host``
        the collectives of its host's workers, and its chunk's all-reduce among its replicas;
        with ``--compress``, its all-reduces of a compressed step, the copy of its error apart:
        ``copy_bytes_per_step``)."""
        n = self._shards
        p, g, _ = self._pgk
        if self.compressed is not None:  # the buckets are fp32 (the default --reduce-fp32)
            if not self._partitioned:
                return 2 * (n - 1) / n * self.compressed[0]
            # stages 1 and 2: int8's reduce-scatter, or PowerSGD's all-reduces, then the parameters' all-gather
            reduced = (1 if self.compress == "int8" else 2) * (n - 1) / n * self.compressed[0]
            return reduced + (n - 1) / n * p * self.params
        share = (n - 1) / n
        if "gradients" not in self._partitioned and "optimizer" not in self._partitioned:
            per_param = 2 * share * g
        elif "parameters" in self._partitioned and self.reshard:
            per_param = share * (2 * p + g - p * self.gathered_once / self.params)
        else:
            per_param = share * (g + p)
        if n < self.workers:
            h = self.workers // n
            per_param += 2 * (h - 1) / h * g / n
        return per_param * self.params

    def error_bytes(self) -> float:
        """With ``--compress``: the bytes of error feedback each worker holds, its own and its
        copy of its neighbour's, fp32 and bucket-sized (and, at ZeRO stages 1 and 2, both as
        of the step before too: a re-formation may restore the chunks a committed step back)."""
        if self.compressed is None:
            return 0.0
        held = (2 if self.workers > 1 else 1) * self.compressed[1]
        return 2 * held if self._partitioned else held

    def copy_bytes_per_step(self) -> float:
        """With ``--compress``: bytes of its error each worker copies to its near neighbour per
        compressed step (a rank of its host, where it has one: docs/compression.md)."""
        return float(self.compressed[1]) if self.compressed is not None and self.workers > 1 else 0.0

    def link_bytes_per_step(self) -> dict[str, float]:
        """Bytes each host sends over its link per step, by how the step communicates (needs
        ``hosts``): stage 0 ``flat`` and ``hierarchical``; a sharded stage on ``gloo`` (all-to-alls)
        and on ``nccl`` (rings) at ``--shard-scope all``, and at ``--shard-scope host`` (``host``)."""
        if self.hosts is None:
            return {}
        h, n = self.hosts, self.workers
        w = n // h
        p, g, _ = self._pgk
        if h == 1:
            keys = ("compressed",) if self.compressed is not None else ("flat", "hierarchical") \
                if not self._partitioned else ("gloo", "nccl", "host")
            return {k: 0.0 for k in keys}
        copies = self.copy_bytes_per_step() if w == 1 else 0.0  # the error copies cross only from lone ranks
        if self.compressed is not None and self.compress_scope == "hosts":  # int8 on the hop between hosts alone
            return {"compressed": 2 * (h - 1) / h * self.compressed[0] + copies}
        if self.compressed is not None and self._partitioned:  # gloo: int8's all-to-all or PowerSGD's flat ring,
            reduced = (w * (h - 1) / h if self.compress == "int8" else 2 * (n - 1) / n) * self.compressed[0]
            return {"compressed": reduced + w * (h - 1) / h * p * self.params + copies}  # and the gathers' all-to-all
        if self.compressed is not None:  # a flat ring of the compressed bytes
            return {"compressed": 2 * (n - 1) / n * self.compressed[0] + copies}
        if not self._partitioned:
            return {"flat": 2 * (n - 1) / n * g * self.params, "hierarchical": 2 * (h - 1) / h * g * self.params}
        moved = ((2 * p + g) * self.params - p * self.gathered_once if "parameters" in self._partitioned and self.reshard
                 else (p + g) * self.params)
        return {"gloo": w * (h - 1) / h * moved, "nccl": (n - 1) / n * moved,
                "host": 2 * (h - 1) / h * g * self.params}

    def report(self, gpu_memory: float | None = None) -> dict:
        out = {"inputs": {**asdict(self), "gpu_memory": gpu_memory},
               "bytes_per_param": self.bytes_per_param(),
               "per_worker_bytes": self.per_worker_bytes(),
               "per_worker_bytes_by_stage": {
                   str(z): MemoryPlan(self.params, self.workers, z, self.precision, self.optimizer, hosts=self.hosts,
                                      shard_scope=self.shard_scope if z else "all").per_worker_bytes()["total"]
                   for z in STAGES},
               "snapshot_bytes": self.snapshot_bytes(),
               "gathered_bytes": self.gathered_bytes(),
               "comm_bytes_per_step": self.comm_bytes_per_step()}
        if self.compressed is not None:
            out["compress"] = {"compressor": self.compress, "copy_bytes_per_step": self.copy_bytes_per_step(),
                               "error_bytes_per_worker": self.error_bytes(),
                               "uncompressed_bytes_per_step": MemoryPlan(self.params, self.workers, self.zero,
                                                                         self.precision,
                                                                         self.optimizer).comm_bytes_per_step()}
        if self.hosts is not None:
            out["link_bytes_per_host_per_step"] = self.link_bytes_per_step()
        if self.spares:
            out["spares"] = {"workers": self.spares, "devices": self.workers + self.spares,
                             "bytes_each_once_promoted": self.per_worker_bytes()["total"]}
        if gpu_memory is not None:
            out["fits"] = self.per_worker_bytes()["total"] + self.gathered_bytes() <= gpu_memory
            out["workers_needed"] = self.workers_needed(gpu_memory)
            if self.gathered_bytes():
                out["workers_needed_with_gathered_units"] = self.workers_needed(gpu_memory, with_units=True)
        return out


def render(plan: MemoryPlan, gpu_memory: float | None = None) -> str:
    r = plan.report(gpu_memory)
    gib = 2**30
    lines = [(f"elastic_dp plan: {plan.params:.3g} parameters, {plan.workers} workers, ZeRO stage {plan.zero}, "
              f"{plan.precision} parameters, {plan.optimizer}"),
             "  per worker          bytes/param        GiB"]
    for key in ("parameters", "gradients", "optimizer_state", "total"):
        lines.append(f"    {key.replace('_', ' '):16} {r['bytes_per_param'][key]:10.3f}  {r['per_worker_bytes'][key] / gib:10.2f}")
    by_stage = " / ".join(f"{v / gib:.2f}" for v in r["per_worker_bytes_by_stage"].values())
    lines.append(f"  stages {' / '.join(map(str, STAGES))} per worker: {by_stage} GiB")
    if "parameters" in STAGES[plan.zero].partitioned:
        lines.append(f"  gathered units in flight: {r['gathered_bytes'] / gib:.2f} GiB more at the busiest moment"
                     if r["gathered_bytes"] else "  gathered units in flight: give --unit-params (the largest unit's "
                     "parameters) to add them")
    snap = r["snapshot_bytes"]
    if snap["host"]:
        lines.append(f"  peer snapshots per worker: {snap['host'] / gib:.2f} GiB of host memory "
                     f"({snap['host_neighbour_on_same_host'] / gib:.2f} GiB with the neighbour on the same host); "
                     f"with NCCL, {snap['device_while_sent'] / gib:.2f} GiB more on the device while one is sent")
    lines.append(f"  communication per step: {r['comm_bytes_per_step'] / 1e9:.3f} GB sent by each worker")
    if plan.compressed is not None and plan.compress_scope == "hosts":
        lines.append(f"  --compress {plan.compress} --compress-scope hosts: the hop between the hosts alone is int8 (the "
                     "link figure below); inside a host fp32, as the hierarchical all-reduce")
    elif plan.compressed is not None:
        c = r["compress"]
        lines.append(f"  --compress {plan.compress}: {r['comm_bytes_per_step'] / 1e6:.4g} MB, "
                     f"{r['comm_bytes_per_step'] / c['uncompressed_bytes_per_step']:.3f} of the "
                     f"{c['uncompressed_bytes_per_step'] / 1e6:.4g} MB uncompressed, once compression starts; and "
                     f"{c['copy_bytes_per_step'] / 1e6:.4g} MB of its error copied to a neighbour on its host")
    if plan.compressed is not None:
        lines.append(f"  error feedback held per worker: {r['compress']['error_bytes_per_worker'] / gib:.2f} GiB (its "
                     "own and its copy of a neighbour's" + (", as of this step and the one before)" if plan.zero
                                                            else ")"))
    if plan.hosts is not None:
        per_host = ", ".join(f"{'--shard-scope host' if k == 'host' else k} {v / 1e6:.4g} MB"
                             for k, v in r["link_bytes_per_host_per_step"].items())
        lines.append(f"  over each host's link per step ({plan.hosts} hosts of {plan.workers // plan.hosts} workers): "
                     f"{per_host}")
    if plan.spares:
        lines.append(f"  spares: {plan.spares} more worker(s), {plan.workers + plan.spares} devices in all; each "
                     f"needs the {r['per_worker_bytes']['total'] / gib:.2f} GiB above once promoted")
    if gpu_memory is not None:
        need = r["workers_needed"]
        lines.append(f"  on {gpu_memory / 1e9:.3g} GB devices: " + ("fits" if r["fits"] else "does NOT fit")
                     + f" at {plan.workers} workers; "
                     + (f"the training state needs at least {need} device(s) at stage {plan.zero}" if need
                        else f"no number of devices is enough at stage {plan.zero}"))
        if "workers_needed_with_gathered_units" in r:
            more = r["workers_needed_with_gathered_units"]
            lines.append("  with the gathered units: " + (f"at least {more} device(s)" if more
                                                           else "no number of devices is enough"))
    lines.append("  (training state only: activations, temporary buffers and allocator overhead come on top)")
    return "\n".join(lines)
