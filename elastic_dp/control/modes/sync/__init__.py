"""Synchronous data parallelism: the mode (``SyncMode``) and its state layouts."""

from elastic_dp.control.modes.sync.mode import SyncMode

__all__ = ["SyncMode"]
