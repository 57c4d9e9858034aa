"""Synchronous data parallelism: the mode (``SyncMode``) and its state layouts."""

from .mode import SyncMode

__all__ = ["SyncMode"]
