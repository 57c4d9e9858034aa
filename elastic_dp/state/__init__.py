"""State strategies: how a worker holds the training state, reduces gradients and updates.

A strategy is an object with one interface (``base.Strategy``), built once per worker by
``stages.make_strategy`` from the part of the run's ZeRO stage (``zero.settings.STAGES``,
which names each stage's strategy); the worker's step and its state calls do not branch
on which one it has. Strategies are named by what they keep:

    replicated.Replicated           ZeRO stage 0: every worker holds everything; gradients
                                    all-reduced in buckets overlapped with backward
    replicated.Unreduced            the same state, the gradients each worker's own: for a
                                    mode that reduces none (async, diloco); no reducer
    zero/stage1.ShardedOptimizer    stage 1: the optimizer state sharded
    zero/stage2.ShardedGradients    stage 2: the gradients too
    zero/stage3.FullySharded        stage 3: the parameters too, gathered unit by unit

The sharded ones (``zero.sharded.Sharded``) also implement what resharding needs
(``base.Resharding``: ``holdings``, ``export``, ``import_chunks``).
"""
