"""Durable state: checkpoints written in parts by every rank, and the storage they go to (paths, pyarrow.fs URIs)."""
