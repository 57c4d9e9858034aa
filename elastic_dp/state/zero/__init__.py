"""ZeRO: chunk arithmetic, the sharded state of stages 1 and 2, their checkpoint format, peer snapshots and the shared memory they use on one host."""
