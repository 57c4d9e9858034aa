"""Asynchronous SGD, worker side: the gradient program and the parameter-server shard actor."""
