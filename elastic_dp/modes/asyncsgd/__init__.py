"""Asynchronous SGD over parameter-server shards (``--mode async``)."""
