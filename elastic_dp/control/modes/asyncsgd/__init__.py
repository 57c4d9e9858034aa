"""Asynchronous SGD over parameter-server shards (``--mode async``)."""

from elastic_dp.control.modes.asyncsgd.mode import AsyncMode

__all__ = ["AsyncMode"]
