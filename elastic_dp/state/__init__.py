"""State strategies: how a worker holds the training state, reduces gradients and updates.

A strategy is an object with one interface (``base.Strategy``), built once per worker by
``stages.make_strategy``; the worker's step and its state calls do not branch on which one it
has. Strategies are named by what they keep:

    replicated.Replicated           ZeRO stage 0: every worker holds everything; gradients
                                    all-reduced in buckets overlapped with backward
    zero/stage1.ShardedOptimizer    stage 1: the optimizer state sharded
    zero/stage2.ShardedGradients    stage 2: the gradients too
    zero/stage3.FullySharded        stage 3: the parameters too, gathered unit by unit

The sharded ones (``zero.sharded.Sharded``) also implement what resharding needs
(``base.Resharding``: ``holdings``, ``export``, ``import_chunks``).
"""
