"""The data plane: which samples each step trains on, and the readers that fetch them.

``elastic_dp.data.sampler``: the elastic sampler (step -> global batch -> per-worker
slices), imported here. The readers, imported when first used: ``ParquetRows``
(``elastic_dp.data.parquet``: Parquet files, local or on an object store, by row),
``RayRows`` (``elastic_dp.data.raydata``: a Ray Dataset's rows in the object store), and
the read-ahead cache they and ``elastic_dp.tokens.TokenWindows`` share
(``elastic_dp.data.ahead``).
"""

from typing import Any

from elastic_dp.data.sampler import (
    ElasticSampler,
    check_resumable,
    check_same_run,
    micro_batches,
    rank_slice,
    split,
)

_READERS = {"ParquetRows": "elastic_dp.data.parquet", "RayRows": "elastic_dp.data.raydata"}


def __getattr__(name: str) -> Any:
    """A reader, imported when it is first used (pyarrow's and Ray Data's imports are not
    every worker's)."""
    if name not in _READERS:
        raise AttributeError(f"module 'elastic_dp.data' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_READERS[name]), name)


__all__ = [
    "ElasticSampler",
    "ParquetRows",
    "RayRows",
    "check_resumable",
    "check_same_run",
    "micro_batches",
    "rank_slice",
    "split",
]
