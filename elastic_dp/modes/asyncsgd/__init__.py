"""Asynchronous SGD over parameter-server shards (``--mode async``)."""

from .mode import AsyncMode

__all__ = ["AsyncMode"]
