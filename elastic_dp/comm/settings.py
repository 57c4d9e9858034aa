"""The gradient buckets' settings (the bucketed reducer: ``elastic_dp.comm.reducer``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic_dp.comm.compression import Int8Spec, PowerSGDSpec, parse_compress
from elastic_dp.errors import ConfigError
from elastic_dp.settings import OMIT, setting


@dataclass(kw_only=True, slots=True, frozen=True)
class Buckets:
    """How gradients are cut into buckets and reduced while backward goes on."""

    bucket_mb: float = setting(
        25.0, "--bucket-mb", "gradient bucket size in MiB (default 25); each full bucket is reduced while backward "
        "goes on; buckets are also ZeRO's unit of sharding")
    first_bucket_mb: float | None = setting(
        None, "--first-bucket-mb", "the first bucket (the last layers' gradients, the first that backward produces) "
        "closes at this many MiB, so that its reduction overlaps the rest of backward (default: 1 on a GPU, as DDP's; "
        "on a CPU none smaller than --bucket-mb: gloo's threads take the cores the compute needs, and the second "
        "collective cost more than the overlap gave, docs/sync.md)", kind=float)
    all_reduce: Literal["flat", "hierarchical"] | None = setting(
        None, "--all-reduce", choices=("flat", "hierarchical"), kind=str, help=(
            "how ZeRO stage 0 all-reduces each gradient bucket: flat, one ring over every rank; hierarchical, a "
            "reduce-scatter among the ranks of each host, an all-reduce of each piece across the hosts, an "
            "all-gather inside each host, which sends 2(H-1)/H of the gradient bytes over each of H hosts' links "
            "instead of about 2x (default: hierarchical when the workers span more than one host and a host holds "
            "more than one of them, else flat; docs/hosts.md)"))
    reduce_fp32: bool = setting(True, off="--no-reduce-fp32",
                                help="reduce bf16 gradients in bf16 (default: in fp32, even when parameters are bf16)")
    compress: str | None = setting(
        None, "--compress", kind=str, metavar="powersgd:rank=R[:start=S][:min-ratio=X]|int8",
        identity=lambda value, train: OMIT if value is None else value, help=(
            "compress each gradient bucket's all-reduce (ZeRO stage 0) or reduce-scatter (stages 1 and 2, with "
            "--snapshot-every 1): powersgd reduces each gradient matrix to a "
            "rank-R approximation of the sum over the workers with error feedback, as torch's PowerSGD hook does, "
            "after S steps uncompressed (default 10), the matrices whose elements are more than X times the "
            "factors' (default 2); the run follows the contract of PowerSGD applied to the global gradient with one "
            "error buffer at any worker count, a lost worker's error taken over from its copy on a neighbour; int8 "
            "sends each bucket as blockwise-scaled int8, each worker's quantization error fed back, the members "
            "simulated by its contract (docs/compression.md)"))

    compress_scope: Literal["all", "hosts"] = setting(
        "all", "--compress-scope", choices=("all", "hosts"), identity=lambda value, train: OMIT if value == "all"
        else value, help=(
            "with --compress int8: all (default) quantizes every byte of the all-reduce; hosts only the hop between "
            "the hosts: each bucket summed inside each host exactly (fp32), each piece all-reduced across the hosts "
            "as int8, gathered inside the host, the hierarchical all-reduce's steps (docs/compression.md)"))

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be positive, got {self.bucket_mb} (--bucket-mb)")
        if self.first_bucket_mb is not None and self.first_bucket_mb <= 0:
            raise ConfigError(f"first_bucket_mb must be positive, got {self.first_bucket_mb} (--first-bucket-mb)")
        spec = parse_compress(self.compress)
        if self.compress_scope == "hosts" and not isinstance(spec, Int8Spec):
            raise ConfigError(f"--compress-scope hosts compresses the hop between the hosts of the hierarchical "
                              f"all-reduce, which cuts each bucket into pieces: int8 quantizes a piece, and "
                              f"{'no --compress' if spec is None else '--compress ' + self.compress} is not defined "
                              "on one (PowerSGD's matrices span the pieces): use --compress int8, or drop "
                              "--compress-scope")
        if self.compress_scope == "hosts" and self.all_reduce == "flat":
            raise ConfigError("--compress-scope hosts compresses the hop between the hosts of the hierarchical "
                              "all-reduce, and --all-reduce flat asks for one ring: drop one of them")

    @property
    def compressor(self) -> PowerSGDSpec | Int8Spec | None:
        """``--compress``, parsed (None: the buckets are all-reduced as they are)."""
        return parse_compress(self.compress)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    def first_bucket_bytes(self, device_type: str) -> int:
        """Where the first bucket closes, in bytes, for workers on ``device_type`` (at most a bucket)."""
        mb = self.first_bucket_mb
        if mb is None:
            mb = 1.0 if device_type == "cuda" else self.bucket_mb
        return int(min(mb, self.bucket_mb) * 2**20)
