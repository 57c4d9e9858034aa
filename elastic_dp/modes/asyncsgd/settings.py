"""The settings of ``--mode async``: staleness and the parameter-server shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from elastic_dp.errors import ConfigError
from elastic_dp.modes.settings import ModeSettings
from elastic_dp.settings import setting


@dataclass(kw_only=True, slots=True, frozen=True)
class AsyncSettings(ModeSettings):
    """Asynchronous SGD: each worker trains whole steps on parameters it pulled from the
    parameter-server shards, whose updates are applied as they come (docs/async.md)."""

    name = "async"
    driver = "elastic_dp.modes.asyncsgd.mode:AsyncMode"
    program = "elastic_dp.modes.asyncsgd.program:AsyncProgram"
    max_staleness: int = setting(4, "--max-staleness", help=(
        "an update computed on a version more than this many updates old is not applied; its worker pulls again "
        "and recomputes (default 4)"))
    staleness_lr: Literal["none", "inverse"] = setting("none", "--staleness-lr", choices=("none", "inverse"), help=(
        "inverse divides a stale update's learning rate by staleness + 1"))
    ps_shards: int = setting(1, "--ps-shards", help=(
        "parameter-server shards, each a Ray actor holding a contiguous part of the parameters and its optimizer "
        "state (default 1)"))
    ps_device: Literal["cpu", "cuda"] = setting("cpu", "--ps-device", choices=("cpu", "cuda"), help=(
        "where the shards keep that state: cuda runs their optimizer steps on a GPU, at the price of GPU memory "
        "and capacity the workers then do not have (default cpu)"))
    snapshot_every: int = setting(1, "--snapshot-every", help=(
        "async: every K versions every parameter-server shard copies its state, kept by its keeper (the next shard, "
        "or a keeper actor of a lone shard), from which a lost shard is restored (default 1; docs/async.md)"))

    def __post_init__(self) -> None:
        for name, flag, low in (("max_staleness", "--max-staleness", 0), ("ps_shards", "--ps-shards", 1),
                                ("snapshot_every", "--snapshot-every", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"{name} must be >= {low}, got {getattr(self, name)} ({flag})")

    def unreachable(self, fault: Any, train: Any) -> str | None:
        if fault.kind == "slowlink":
            return "--mode async has no collective group: its workers exchange with the parameter servers"
        return None

    def check(self, train: Any) -> None:
        if train.eval_every is not None:
            raise ConfigError("--eval-every evaluates between synchronous steps; --mode async has none yet: drop it, "
                              "or use --mode sync")
