"""A Ray Data ``Dataset`` as a task's dataset: its rows in the object store, by index.

``Task.dataset`` may return a ``ray.data.Dataset``. The driver builds it once, after Ray
is up (``with_ray_data``), refuses one whose order is not deterministic, and executes it
once (``Dataset.materialize``): its blocks stay in the object store (or spilled), owned by
the driver, for the run. The workers get ``RayRows``: the blocks' references and row
counts, no rows. A worker reads the rows of its slices from the blocks, by block, read ahead
as the steps come (``elastic_dp.data.ahead``); nothing passes through the driver.

The contract: training sample ``i`` is the ``i``-th row that ``Dataset.iter_rows()``
yields, with ``DataContext.get_current().execution_options.preserve_order = True`` set
before the dataset is built (a user's own loop lists the rows that way), as the row
``iter_rows`` yields it: a dict of its columns (numbers, numpy arrays for tensor
columns), which ``default_collate`` turns into tensors as it does for a map-style dataset.
A run's position is its step, so a kill, a join, a resize and a resume at another worker
count read the same rows in the same order; a resumed run builds and executes the dataset
again, which a deterministic dataset makes the same rows.

Refused, naming the setting: a dataset built without ``preserve_order`` (Ray Data then
yields blocks in the order its tasks finish), and a ``random_shuffle`` or
``randomize_block_order`` without a ``seed``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from elastic_dp.data.ahead import ROW_OBJECT_BYTES, PieceRows, detached
from elastic_dp.errors import TaskError

logger = logging.getLogger(__name__)

CACHE_MB = 256
"""The rows read ahead that a process keeps, in MiB (``RayRows.cache_mb``)."""
INFLIGHT = 4
"""Blocks on their way at once."""

_RANDOM_OPERATORS = {"RandomShuffle": "random_shuffle", "RandomizeBlocks": "randomize_block_order"}


class RayRows(PieceRows):
    """The rows of an executed Ray Dataset, by index (the module docstring): the blocks'
    references, each with the rows of it that the dataset holds (a block may be sliced); a
    piece is a block."""

    LOCAL = (*PieceRows.LOCAL, "materialized")  # the driver's hold on the blocks stays there
    cache_name = "edp-raydata"

    def __init__(self, blocks: list[tuple[Any, int, int, int]], columns: int, *, cache_mb: float = CACHE_MB,
                 inflight: int = INFLIGHT) -> None:
        self.blocks = blocks
        """(object reference, first row, stop row, the block's bytes) for each block, in order."""
        self.starts = [0]
        for _, first, stop, _ in blocks:
            self.starts.append(self.starts[-1] + stop - first)
        rows = max(1, self.starts[-1])
        self.row_bytes = max(1, sum(b[3] for b in blocks) // rows) + ROW_OBJECT_BYTES * (1 + columns)
        self.cache_bytes, self.inflight = int(cache_mb * 2**20), inflight
        self._local_state()

    @classmethod
    def of(cls, dataset: Any, **options: Any) -> RayRows:
        """Execute ``dataset`` once (refused if its order is not deterministic) and hold its blocks."""
        check_deterministic(dataset)
        materialized = dataset.materialize()
        blocks = []
        for bundle in materialized.iter_internal_ref_bundles():
            for entry, part in zip(bundle.blocks, bundle.slices):
                rows = entry.metadata.num_rows
                first, stop = (0, rows) if part is None else (part.start_offset, part.end_offset)
                if stop > first:
                    blocks.append((entry.ref, first, stop, entry.metadata.size_bytes or 0))
        columns = len(materialized.schema().names) if materialized.schema() is not None else 1
        rows = cls(blocks, columns, **options)
        rows.materialized = materialized  # holds the blocks for the run, on the driver
        return rows

    def _fetch(self, block: int, rows: list[int]) -> list[tuple[dict[str, Any], int]]:
        """Rows ``rows`` of block ``block``, as ``iter_rows`` yields them."""
        import ray
        from ray.data.block import BlockAccessor

        ref, first, _, _ = self.blocks[block]
        accessor = BlockAccessor.for_block(ray.get(ref))
        base = self.starts[block] - first  # row i is the block's row i - base
        out = []
        for i in rows:
            piece = BlockAccessor.for_block(accessor.slice(i - base, i - base + 1, copy=False))
            out.append((detached(next(iter(piece.iter_rows(public_row_format=True)))), self.row_bytes))
        return out


def check_deterministic(dataset: Any) -> None:
    """Refuse a Ray Dataset whose rows would come in another order on another execution."""
    if not dataset.context.execution_options.preserve_order:
        raise TaskError("Task.dataset returned a Ray Dataset built without preserve_order, whose rows come in the "
                        "order its tasks finish: set ray.data.DataContext.get_current().execution_options."
                        "preserve_order = True before building it (in the dataset factory), so that sample i is "
                        "the i-th row iter_rows() yields")
    dag = getattr(getattr(dataset, "_logical_plan", None), "dag", None)
    for op in (dag.post_order_iter() if dag is not None else ()):
        name = _RANDOM_OPERATORS.get(type(op).__name__)
        seed = getattr(getattr(op, "seed_config", None), "seed", 0)
        if name is not None and seed is None:
            raise TaskError(f"Task.dataset returned a Ray Dataset with {name}() without a seed, whose order differs "
                            f"on every execution: pass {name}(seed=...)")


def is_ray_dataset(value: Any) -> bool:
    """``value`` is a ``ray.data.Dataset`` (without importing Ray Data when it is not loaded)."""
    import sys

    data = sys.modules.get("ray.data")
    return data is not None and isinstance(value, data.Dataset)


def _rows(rows: RayRows) -> RayRows:
    return rows


def with_ray_data(task: Any, built: Any = None, *, build: bool = True, evaluates: bool = False) -> Any:
    """``task`` with each of its datasets that is a Ray Dataset replaced by its ``RayRows``
    (built on this driver, Ray up). ``built``: the training dataset the driver built already
    (not built again); ``build``: without ``built``, build it here to look at it (False: the
    driver's own build is still going on, which a Ray Data factory's never is: it fails at
    once without Ray). ``evaluates``: the run evaluates (``--eval-every``), so its eval
    dataset is looked at too. A factory that fails here is left to the workers, which report
    what fails."""
    changes = {}
    for field in ("dataset", "eval_dataset") if evaluates else ("dataset",):
        factory = getattr(task, field)
        value = built if field == "dataset" else None
        if factory is None or (value is None and field == "dataset" and not build):
            continue
        if value is None:
            try:
                value = factory()
            except Exception:  # the workers build it too, and say what fails
                logger.debug("Task.%s could not be built on the driver", field, exc_info=True)
                continue
        if is_ray_dataset(value):
            changes[field] = functools.partial(_rows, RayRows.of(value))
    return dataclasses.replace(task, **changes) if changes else task
