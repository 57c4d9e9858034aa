"""The task: plain PyTorch pieces that say what to train. No base class to inherit.

A job module exposes one ``Task`` as ``TASK`` so that the CLI, a Ray job entrypoint,
the tests and a reference loop all build the same model, dataset and optimizer.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.data import Dataset, default_collate

from elastic_dp.config import TrainConfig
from elastic_dp.errors import TaskError


@dataclass(kw_only=True)
class Task:
    """Factories and the loss of a training job, plus its default hyper-parameters.

    The factories run inside every worker (and in reference loops); they must be
    importable functions or picklable callables.
    """

    model: Callable[[], torch.nn.Module]
    """Builds the model. Called after ``torch.manual_seed(seed)`` on every worker."""
    dataset: Callable[[], Dataset]
    """Builds a map-style dataset (``__len__`` and ``__getitem__``)."""
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    """``loss(model, batch)`` returns the *mean* loss over the samples of ``batch`` as a
    scalar tensor. elastic_dp multiplies it by the batch's sample count and divides by
    the global batch, so gradients are per-sample sums over the global batch divided by
    ``B`` whatever the worker count."""
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    """Builds the optimizer over the model's parameters (param groups allowed). The
    learning rates it sets are the base rates that the schedule and linear scaling multiply."""
    eval_dataset: Callable[[], Dataset] | None = None
    """Optional: builds the held-out map-style dataset that ``--eval-every`` evaluates (the
    task's ``loss`` in ``model.eval()`` mode, without gradients; the reported loss is the
    mean over its samples)."""
    lr_schedule: Callable[[int], float] | None = None
    """Optional: ``step -> factor`` on the base learning rates, a pure function of the
    (0-based) step, used instead of ``TrainConfig.lr_schedule`` and its warmup; linear
    scaling (``lr_reference_batch``) still multiplies it."""
    scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None
    """Optional: builds a torch ``LRScheduler`` over the optimizer it is given, stepped once
    per committed step (never twice for a re-run one), its state in checkpoints and in a
    joiner's state; used instead of ``TrainConfig.lr_schedule`` (``elastic_dp.schedules``).
    It may set the learning rate only, from the step alone (no ``ReduceLROnPlateau``)."""
    shard_units: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None
    """Optional, ``--zero 3``: the modules whose parameters are gathered together for their
    forward and backward (default: the children of the model's ``nn.ModuleList``s, its
    repeated blocks); the parameters outside them form the root unit (docs/zero.md)."""
    keep_fp32: Callable[[str, torch.nn.Module], bool] | Sequence[str] | None = None
    """Optional, ``--zero 3 --param-dtype bf16``: the modules whose parameters stay fp32 whole
    (gathered, computed and reduced in fp32; their inputs cast to fp32, their outputs back
    to bf16): a predicate ``keep_fp32(name, module)`` or module names (fnmatch patterns), as
    PyTorch users keep an MoE's router or the norms; ``--keep-fp32`` adds patterns."""
    init_module: Callable[[torch.nn.Module, str, torch.nn.Module], None] | None = None
    """Optional, ``--init units`` (the default at ``--zero 3``): ``init_module(model, name,
    module)`` initialises the parameters and buffers ``module`` (named ``name`` in
    ``model``) owns itself, not its children's, just materialised uninitialised on the
    device; the rest of ``model`` may not be materialised yet. Default: the model's own
    ``model._init_weights(module)`` where it has one (a Hugging Face ``PreTrainedModel``),
    else ``module.reset_parameters()`` (docs/zero.md, the initialisation rule)."""
    collate: Callable[[list], Any] = default_collate
    """Turns a list of samples into a batch (default: torch's ``default_collate``)."""
    defaults: TrainConfig = field(default_factory=TrainConfig)
    """Default hyper-parameters of the job; the CLI and the API override them."""
    sample: Callable[[torch.nn.Module], str] | None = None
    """Optional: a short text showing what the trained model does (the GPT job generates
    text). Run on rank 0 after the last step; shown in the run summary."""
    tokens_per_sample: int | None = None
    """Optional: tokens in one sample; the run then reports tokens/s."""
    flops_per_sample: float | None = None
    """Optional: training FLOPs of one sample, forward and backward; the run then reports
    model FLOPs utilisation against the peak (``--peak-tflops``, or known GPUs')."""


def load_task(job: str) -> Task:
    """Import job module ``job`` and return its ``TASK``."""
    try:
        module = importlib.import_module(job)
    except ModuleNotFoundError as exc:
        if exc.name and job.startswith(exc.name):
            raise TaskError(f"no job module named {job!r}: pass an importable module that "
                            "defines TASK, such as jobs.gpt") from None
        raise
    task = getattr(module, "TASK", None)
    if not isinstance(task, Task):
        raise TaskError(f"job module {job!r} has no TASK of type elastic_dp.Task: define "
                        "TASK = Task(model=..., dataset=..., loss=..., optimizer=...) in it")
    return task


def trainable(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the optimizer steps, by name in the model's order (a tied parameter
    once): what ``--mode async`` flattens and shards over its parameter servers."""
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) in stepped]


def kept_in_fp32(task: Task, model: torch.nn.Module, patterns: Sequence[str] = ()) -> list[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that ``Task.keep_fp32`` and ``patterns`` (``--keep-fp32``) keep
    in fp32 under ``--param-dtype bf16``, outermost first (a kept module's children are its)."""
    import fnmatch

    rule = task.keep_fp32
    names = tuple(patterns) + (tuple(rule) if rule is not None and not callable(rule) else ())
    kept: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(k + ".") for k, _ in kept):
            continue
        if any(fnmatch.fnmatchcase(name, n) for n in names) or (callable(rule) and rule(name, module)):
            kept.append((name, module))
    return kept
