"""A job whose module keeps state between builds, as user code sometimes does (a counter, a
cache), and which sets an environment variable: what a kept worker must not carry from one
run into the next (tests/test_kept_workers.py). Each build reads the state it finds: a
second build in the same module, or a variable left by a run before, changes the model."""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from tests.tasks import MLP_TASK, mlp

BUILDS = 0
"""Models built since this module was imported."""
VARIABLE = "EDP_STATEFUL_JOB_RAN"


def model() -> nn.Module:
    global BUILDS
    BUILDS += 1
    built = mlp()
    with torch.no_grad():  # a model that shows what the module and the environment held
        built[0].bias.add_(BUILDS - 1 + float(os.environ.get(VARIABLE, "0")))
    os.environ[VARIABLE] = "1"
    return built


TASK = dataclasses.replace(MLP_TASK, model=model)
