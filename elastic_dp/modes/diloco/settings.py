"""The settings of ``--mode diloco``: the outer loop (``elastic_dp.modes.diloco.program``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from elastic_dp.errors import ConfigError
from elastic_dp.modes.settings import ModeSettings
from elastic_dp.settings import setting


@dataclass(kw_only=True, slots=True, frozen=True)
class DiLoCoSettings(ModeSettings):
    """DiLoCo / local SGD: ``sync_every`` inner steps alone, then one outer step together."""

    name = "diloco"
    driver = "elastic_dp.modes.diloco.mode:DiLoCoMode"
    program = "elastic_dp.modes.diloco.program:DiLoCoProgram"
    sync_every: int = setting(50, "--sync-every", help="diloco: inner steps per outer step, H (default 50)")
    outer_lr: float = setting(0.7, "--outer-lr", help="diloco: the outer SGD's learning rate (default 0.7)")
    outer_momentum: float = setting(0.9, "--outer-momentum", help=(
        "diloco: the outer SGD's momentum, in [0, 1) (default 0.9; 0 is plain SGD: local SGD is --outer-lr 1 "
        "--outer-momentum 0)"))
    outer_nesterov: bool = setting(True, off="--no-outer-nesterov", help=(
        "diloco: plain momentum in the outer SGD instead of Nesterov's momentum"))
    outer_reduce: Literal["fp32", "bf16", "int8", "int4"] = setting(
        "fp32", "--outer-reduce", choices=("fp32", "bf16", "int8", "int4"), help=(
            "diloco: how the pseudo-gradient's all-reduce carries it: fp32, bf16 (half the bytes, the sum rounded), or "
            "int8 and int4 (blockwise-scaled integers, about a quarter and an eighth of the bytes, each member's "
            "quantization error carried to its next outer step; docs/diloco.md)"))
    fragments: int = setting(1, "--fragments", help=(
        "diloco: Streaming DiLoCo, the parameters synced in F fragments, each once a window at its own inner step "
        "(at most --sync-every; default 1, plain DiLoCo)"))
    fragment_delay: int = setting(0, "--fragment-delay", help=(
        "diloco: each fragment's all-reduce overlaps this many inner steps (τ), used τ steps after it is sent; "
        "below --sync-every // --fragments (default 0)"))

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ConfigError(f"sync_every must be >= 1, got {self.sync_every} (--sync-every)")
        if self.outer_lr <= 0:
            raise ConfigError(f"outer_lr must be positive, got {self.outer_lr} (--outer-lr)")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum} (--outer-momentum)")
        if self.fragments < 1:
            raise ConfigError(f"fragments must be >= 1, got {self.fragments} (--fragments)")
        if self.fragment_delay < 0:
            raise ConfigError(f"fragment_delay must be >= 0, got {self.fragment_delay} (--fragment-delay)")
        if self.fragments > self.sync_every:
            raise ConfigError(f"--fragments {self.fragments} syncs each fragment at its own inner step of a window: "
                              f"at most --sync-every {self.sync_every} of them")
        if self.fragment_delay >= self.sync_every // self.fragments:
            raise ConfigError(f"--fragment-delay {self.fragment_delay} must be under the inner steps between two "
                              f"fragments' syncs, --sync-every {self.sync_every} // --fragments {self.fragments} = "
                              f"{self.sync_every // self.fragments}")

    def check(self, train: Any) -> None:
        if train.eval_every and train.eval_every % self.sync_every:
            raise ConfigError(f"--mode diloco evaluates at outer steps: --eval-every {train.eval_every} must be a "
                              f"multiple of --sync-every {self.sync_every}")

    def check_run(self, train: Any, cluster: Any, checkpoint: Any) -> None:
        if checkpoint.enabled and checkpoint.every % self.sync_every:
            raise ConfigError(f"--mode diloco saves checkpoints at outer steps: --checkpoint-every {checkpoint.every} "
                              f"must be a multiple of --sync-every {self.sync_every}")

    def unreachable(self, fault: Any, train: Any) -> str | None:
        if fault.kind == "join" and fault.step % self.sync_every:
            return f"--mode diloco changes membership at outer steps: join at a multiple of --sync-every {self.sync_every}"
        if fault.kind in ("kill", "hang") and fault.phase != "forward":
            return "--mode diloco fires faults in its inner steps' forward (phase=forward) only"
        return None

    @property
    def streaming(self) -> bool:
        """Whether a member's parameters can differ from θ at a window's end."""
        return self.fragments > 1 or self.fragment_delay > 0

    def schedule(self) -> list[tuple[int, int]]:
        """Fragment f's (send, use): after how many of a window's inner steps it is sent and used."""
        return [((f + 1) * self.sync_every // self.fragments - self.fragment_delay,
                 (f + 1) * self.sync_every // self.fragments) for f in range(self.fragments)]
