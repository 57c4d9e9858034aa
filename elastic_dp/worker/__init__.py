"""The worker side: the Ray actor, the replica core, and the worker-side program of each training mode."""
