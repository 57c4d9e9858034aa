"""Synchronous data parallelism: the mode (``SyncMode``) and its state layouts."""
