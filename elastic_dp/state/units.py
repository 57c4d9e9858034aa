"""A model's shard units: which modules they are, how a model built on the meta device
gets its initial parameters one unit at a time, and their activation checkpointing.

The units are the task's ``shard_units(model)``, or by default the children of the
model's outermost ``nn.ModuleList``s (its repeated blocks), in that order: unit ``u`` for
``u = 0 .. U - 1``; the modules outside every unit form the root, unit ``U``. ZeRO stage 3
gathers a unit's parameters for its forward and backward (``zero.stage3``);
``--activation-checkpointing`` recomputes a unit's activations in its backward.

The initialisation rule (``--init units``, the default at ``--zero 3``; docs/zero.md):

1. ``torch.manual_seed(seed)``, then the task's model factory runs with each parameter
   moved to the meta device as it is registered: the model's own initialisation of its
   parameters runs on meta tensors (no memory, no random number drawn); its buffers are
   the factory's, on the worker's device.
2. Each unit, in the order ``0 .. U`` (the root last), is materialised uninitialised on
   the worker's device and initialised with torch's generators seeded with
   ``unit_seed(seed, u)``: every module of the unit that owns parameters itself, in
   ``model.named_modules()`` order, gets ``Task.init_module(model, name, module)``, or
   else its own ``reset_parameters()``. A parameter two modules share is initialised by
   each in turn and keeps the last one's values.
3. The generators are seeded with ``seed`` again: what the training draws (dropout)
   starts from there.

So the initial parameters depend on the seed, the units and the device type only, not
on the ZeRO stage, the world size nor which rank holds what, and a plain replay builds
them by the same rule in one process (tests/test_zero3_init.py writes it out).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch

from elastic_dp.errors import TaskError

GENERATORS = threading.Lock()
"""Torch's generators and nn.Module's registration are the process's: one unit at a time is
initialised, and one model built on the meta device, under it, and no seed is set in the
middle of either (ranks run as threads of one process in tests)."""


def default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the model's ``nn.ModuleList``s, outermost lists only, in
    registration order."""
    units: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList):
                units.extend(child)
            else:
                visit(child)

    visit(model)
    return units


def gathered_once(model: torch.nn.Module, units: list[torch.nn.Module]) -> int:
    """How many of ``model``'s parameters stage 3 gathers once a step rather than twice:
    the root unit's (those in no unit, or shared by two) and the last unit's, which stay
    gathered from their forward to their backward (docs/zero.md). Works on the meta device."""
    owner: dict[int, int | None] = {}
    for u, unit in enumerate(units):
        for param in unit.parameters():
            owner[id(param)] = u if owner.get(id(param), u) == u else None  # shared: the root's
    last = len(units) - 1
    return sum(p.numel() for p in model.parameters() if owner.get(id(p)) in (None, last))


def model_units(model: torch.nn.Module,
                shard_units: Callable[[torch.nn.Module], list[torch.nn.Module]] | None) -> list[torch.nn.Module]:
    """The task's units of ``model`` (``shard_units``; None: ``default_units``), checked."""
    units = list(shard_units(model) if shard_units is not None else default_units(model))
    if any(u is model for u in units):
        raise TaskError("a shard unit cannot be the model itself: its parameters outside the units are the root")
    seen: dict[int, int] = {}
    for u, unit in enumerate(units):
        for module in unit.modules():
            if seen.setdefault(id(module), u) != u:
                raise TaskError(f"Task.shard_units: units {seen[id(module)]} and {u} share a module "
                                f"({type(module).__name__}): the units must be disjoint")
    return units


def unit_seed(seed: int, u: int) -> int:
    """The seed unit ``u`` (the root: the number of units) is initialised under."""
    return (seed * 1_000_003 + u) % 2**63


def build_on_meta(factory: Callable[[], torch.nn.Module], device: torch.device) -> torch.nn.Module:
    """``factory()`` with each parameter moved to the meta device as it is registered (so
    the model's own initialisation runs on meta tensors and draws nothing), then made a
    placeholder on ``device`` without its memory (``UnitInit`` gives it its own); the buffers
    are the factory's, moved to ``device``."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    with GENERATORS:  # the patch is the process's: one build at a time
        torch.nn.Module.register_parameter = on_meta
        try:
            model = factory()
        except Exception as exc:
            raise TaskError(f"the task's model factory failed with its parameters on the meta device (--init units, "
                            f"the default at --zero 3): {type(exc).__name__}: {exc}. Build the model without reading "
                            "parameter values (no .item(), no weights loaded in the factory: load them after), or pass "
                            "--init whole") from exc
        finally:
            torch.nn.Module.register_parameter = register
    placed = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    if placed:
        raise TaskError(f"the task's model factory gave {', '.join(placed[:3])} values outside nn.Module's parameter "
                        "registration (--init units, the default at --zero 3): register them as parameters of a module, "
                        "or pass --init whole")
    memo: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(_unallocated(p, device), requires_grad=p.requires_grad)
                module._parameters[name] = memo[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = b.to(device)
    return model


def _unallocated(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``'s shape over one element (every stride 0): no memory of its size, and a write
    into it (a ``load_state_dict`` before the unit exists) fails instead of overrunning."""
    return torch.empty(1, dtype=t.dtype, device=device).expand(t.shape)


def _own_init(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """The model's own initialisation of one module (a Hugging Face ``PreTrainedModel``'s
    ``_init_weights``, what its ``post_init`` applies to every module)."""
    model._init_weights(module)


class UnitInit:
    """The initialisation rule (module docstring) for a model ``build_on_meta`` made:
    ``unit(u)`` materialises and initialises unit ``u``."""

    def __init__(self, model: torch.nn.Module, units: list[torch.nn.Module], seed: int,
                 init_module: Callable[[torch.nn.Module, str, torch.nn.Module], None] | None,
                 device: torch.device) -> None:
        if init_module is None and callable(getattr(model, "_init_weights", None)):
            init_module = _own_init  # a Hugging Face model: initialised as its from_config would
        self.model, self.seed, self.device, self.init_module = model, seed, device, init_module
        self.root = len(units)
        owner = {id(m): u for u, unit in enumerate(units) for m in unit.modules()}
        self.modules: dict[int, list[tuple[str, torch.nn.Module]]] = {u: [] for u in range(self.root + 1)}
        for name, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is not None:
                self.modules[owner.get(id(module), self.root)].append((name, module))
        if init_module is None:
            missing = [f"{n or '<the model>'} ({type(m).__name__})" for ms in self.modules.values() for n, m in ms
                       if not callable(getattr(m, "reset_parameters", None))]
            if missing:
                raise TaskError(f"--init units (the default at --zero 3) initialises each module that owns parameters "
                                f"with its reset_parameters(), and {', '.join(missing[:4])} has none: give the "
                                "task an init_module(model, name, module), or pass --init whole")
        self.done: set[int] = set()
        self.materialised: set[int] = set()  # the parameters with memory of their own

    def unit(self, u: int) -> None:
        """Materialise unit ``u``'s parameters (each in memory of its own) and initialise them."""
        if u in self.done:
            return
        self.done.add(u)
        for _, module in self.modules[u]:
            for p in module.parameters(recurse=False):
                if id(p) not in self.materialised:
                    self.materialised.add(id(p))
                    p.data = torch.empty(p.shape, dtype=p.dtype, device=self.device)
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with GENERATORS, torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(unit_seed(self.seed, u))
            for name, module in self.modules[u]:
                if self.init_module is not None:
                    self.init_module(self.model, name, module)
                else:
                    module.reset_parameters()

    def all(self) -> None:
        for u in range(self.root + 1):
            self.unit(u)


def checkpoint_units(units: list[torch.nn.Module]) -> None:
    """``--activation-checkpointing``: each unit's forward keeps only its inputs and runs
    again in its backward (torch's non-reentrant ``checkpoint``; the unit's hooks run once,
    around the first)."""
    if not units:
        raise TaskError("--activation-checkpointing recomputes each shard unit's activations, and the model has no "
                        "units (no nn.ModuleList): give the task shard_units(model), or drop it")
    for unit in units:
        unit.forward = functools.partial(_recomputed, unit.forward)


def _recomputed(forward: Callable, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def mixed_precision_hooks(model: torch.nn.Module, units: list[torch.nn.Module],
                          kept: list[torch.nn.Module]) -> None:
    """``--zero 3 --param-dtype bf16``: the floating inputs of the model and of each unit cast
    to bf16, the dtype of their parameters (FSDP2's ``cast_forward_inputs``); each module
    ``kept`` in fp32 has its floating inputs cast to fp32 and its floating outputs back to
    bf16 (FSDP2's ``MixedPrecisionPolicy(param_dtype=float32, output_dtype=bfloat16)`` on it)."""
    from torch.utils._pytree import tree_map

    def to(dtype: torch.dtype) -> Callable:
        def convert(x: object) -> object:
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        return convert

    def inputs(dtype: torch.dtype) -> Callable:
        return lambda _module, args, kwargs: (tree_map(to(dtype), args), tree_map(to(dtype), kwargs))

    for module in [model, *units]:
        module.register_forward_pre_hook(inputs(torch.bfloat16), with_kwargs=True)
    for module in kept:
        module.register_forward_pre_hook(inputs(torch.float32), with_kwargs=True)
        module.register_forward_hook(lambda _module, _args, out: tree_map(to(torch.bfloat16), out))
