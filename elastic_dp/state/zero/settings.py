"""Each ZeRO stage: its settings, what it partitions, its code, and the registry that
``--zero`` chooses from.

A stage is its part here, one line in ``STAGES`` and its code, which the part names: the
worker's state strategy (``strategy``) and the sync mode's driver half of its state
(``layout``), imported when a run first builds them. What the rest of elastic_dp needs to
know of a stage it asks of the part (``partitioned``, ``sharded``, ``shards_parameters``), never
its number.

Stage 0 (replicated state) copies its state to the spares (``--spare-copy-every``);
stages 1-3 keep a copy of each worker's chunk on a peer (``--snapshot-every``); stage 3
alone gathers parameters, and may keep them from the forward to the backward
(``--no-reshard-after-forward``). A setting of a stage the run does not use is refused
(``elastic_dp.settings``). Stages 1-3 shard over every worker or, with ``--shard-scope
host``, inside each host with replicas across hosts (HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from elastic_dp.errors import ConfigError
from elastic_dp.settings import OMIT, setting

SPARE_COPY_EVERY = 10
"""``--spare-copy-every``'s default (docs/elastic.md: what a copy costs, measured)."""


def _snapshot_every() -> Any:
    return setting(1, "--snapshot-every", "with ZeRO, each worker copies its chunk to its neighbour's host memory "
                   "every K committed steps (default 1; into memory both map when they share a host): a worker lost "
                   "k steps after the last copy costs a rollback and replay of those k steps")


def _shard_scope() -> Any:
    return setting("all", "--shard-scope", choices=("all", "host"), kind=str, help=(
        "with ZeRO, over which workers the state is sharded: all (every worker holds one chunk of it), or host (HSDP: "
        "the workers of each host hold one whole copy between them, cut into as many chunks as the largest number "
        "that divides every host's count of workers, and the hosts hold replicas of it); with host the parameter "
        "gathers stay inside the hosts, each chunk's gradient crosses the hosts' links in an all-reduce among its "
        "replicas, and a lost worker or host is restored from a replica with no peer snapshot (default all; "
        "docs/hosts.md)"))


def _check_snapshot_every(value: int) -> None:
    if value < 1:
        raise ConfigError(f"snapshot_every must be >= 1, got {value} (--snapshot-every)")


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage:
    """What every stage's part says of it."""

    number: ClassVar[int]
    """``--zero``'s value."""
    partitioned: ClassVar[frozenset[str]]
    """Which of ``optimizer`` (its state, with the fp32 masters), ``gradients`` and
    ``parameters`` are partitioned over the ranks (each rank holds a chunk of them)."""
    strategy: ClassVar[str]
    """The worker's state strategy (``state.base.Strategy``), as ``module:Class``."""
    layout: ClassVar[str]
    """The sync mode's driver half of the state (``modes.sync.layouts.StateLayout``)."""

    @property
    def sharded(self) -> bool:
        """Each rank holds a chunk of some state: peer snapshots, resharding on resize, and
        the parameters all-gathered after each update."""
        return bool(self.partitioned)

    @property
    def shards_parameters(self) -> bool:
        """No rank holds the whole model: a forward is a collective (every rank runs as
        many), and the whole model (weights, a sample) is gathered unit by unit."""
        return "parameters" in self.partitioned

    @property
    def gathers_bf16(self) -> bool:
        """fp32 parameters are gathered and computed in bf16 (stage 3's ``--param-dtype bf16``)."""
        return False

    @property
    def keep_patterns(self) -> tuple[str, ...]:
        """``--keep-fp32``'s patterns: modules kept in fp32 where the others are gathered in bf16."""
        return ()


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage0(Stage):
    """Replicated state: every worker holds everything."""

    number = 0
    partitioned = frozenset()
    strategy = "elastic_dp.state.replicated:Replicated"
    layout = "elastic_dp.modes.sync.layouts:ReplicatedLayout"
    spare_copy_every: int = setting(
        SPARE_COPY_EVERY, "--spare-copy-every", metavar="K", help=(
            f"with --spares, the replicated state is copied to each spare every K committed steps (default "
            f"{SPARE_COPY_EVERY}; 0: never), in the background of the spare: a spare promoted at a step it holds "
            "receives nothing, and where every member is lost at once the run goes back to the newest spare's copy "
            "and re-runs the steps since, instead of the checkpoint (docs/elastic.md)"))

    def __post_init__(self) -> None:
        if self.spare_copy_every < 0:
            raise ConfigError(f"spare_copy_every must be >= 0, got {self.spare_copy_every} (--spare-copy-every)")


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage1(Stage):
    """The optimizer state (and the fp32 masters of bf16 parameters) sharded."""

    number = 1
    partitioned = frozenset({"optimizer"})
    strategy = "elastic_dp.state.zero.stage1:ShardedOptimizer"
    layout = "elastic_dp.modes.sync.sharded:ShardedLayout"
    snapshot_every: int = _snapshot_every()
    shard_scope: Literal["all", "host"] = _shard_scope()

    def __post_init__(self) -> None:
        _check_snapshot_every(self.snapshot_every)


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage2(Stage):
    """The gradients sharded too, reduce-scattered in buckets during backward."""

    number = 2
    partitioned = frozenset({"optimizer", "gradients"})
    strategy = "elastic_dp.state.zero.stage2:ShardedGradients"
    layout = "elastic_dp.modes.sync.sharded:ShardedLayout"
    snapshot_every: int = _snapshot_every()
    shard_scope: Literal["all", "host"] = _shard_scope()

    def __post_init__(self) -> None:
        _check_snapshot_every(self.snapshot_every)


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage3(Stage):
    """The parameters sharded too, gathered unit by unit for the forward and the backward."""

    number = 3
    partitioned = frozenset({"optimizer", "gradients", "parameters"})
    strategy = "elastic_dp.state.zero.stage3:FullySharded"
    layout = "elastic_dp.modes.sync.sharded:ShardedLayout"
    snapshot_every: int = _snapshot_every()
    shard_scope: Literal["all", "host"] = _shard_scope()
    reshard_after_forward: bool = setting(
        True, off="--no-reshard-after-forward",
        help="--zero 3: keep each unit's gathered parameters from its forward to its backward (one all-gather a unit "
             "less per step, for the memory of the whole model's parameters at the end of the forward)")
    param_dtype: Literal["fp32", "bf16"] = setting(
        "fp32", "--param-dtype", choices=("fp32", "bf16"), identity=lambda value, train: OMIT if value == "fp32" else
        value, help=(
            "--zero 3: the dtype the parameters are gathered and computed in; bf16 keeps fp32 masters in the chunks, "
            "gathers half the bytes, casts each unit's inputs to it and reduces the gradients in fp32 unless "
            "--no-reduce-fp32, as FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (default fp32: "
            "as the model holds them; docs/zero.md)"))
    keep_fp32: str | None = setting(
        None, "--keep-fp32", kind=str, metavar="PATTERN,...", help=(
            "with --param-dtype bf16: the modules (their names in the model, fnmatch patterns such as '*.ln*,router') "
            "whose parameters stay fp32 whole, gathered, computed and reduced in fp32, their inputs cast to fp32 "
            "and their outputs back to bf16 (beside Task.keep_fp32)"))

    def __post_init__(self) -> None:
        _check_snapshot_every(self.snapshot_every)
        if self.keep_fp32 is not None and self.param_dtype != "bf16":
            raise ConfigError(f"--keep-fp32 {self.keep_fp32} keeps modules in fp32 where the others are gathered in "
                              "bf16: add --param-dtype bf16, or drop --keep-fp32")

    @property
    def gathers_bf16(self) -> bool:
        return self.param_dtype == "bf16"

    @property
    def keep_patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in (self.keep_fp32 or "").split(",") if p.strip())


STAGES = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}
"""Each ZeRO stage's settings, by the stage's number (``--zero``)."""
