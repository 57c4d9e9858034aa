"""A job whose dataset is a Ray Dataset (``ray.data.range`` and a ``map_batches``): what a Ray
user brings. Run from the command line, which starts Ray itself after looking at the
dataset (benchmarks/scenarios/test_data_sources.py)."""

from __future__ import annotations

import dataclasses

from tests.tasks import MLP_TASK, parquet_mse, ray_regression

TASK = dataclasses.replace(MLP_TASK, dataset=ray_regression, loss=parquet_mse)
