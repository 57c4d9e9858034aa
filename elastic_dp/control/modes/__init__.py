"""Training modes: how a run trains, chosen once from the configuration.

The coordinator drives a mode through ``TrainingMode`` (``.base``) and never branches on
which one it has. Every mode is built the same way, from the run's ``ModeContext``
(``.context``); adding a mode means adding a package here and an entry to ``registry.MODES``
(its settings: ``settings.py`` in the package, and an entry to ``config.MODES``).

    sync/      synchronous data parallelism: one collective group per generation, the state
               replicated (ZeRO-0) or sharded (ZeRO-1/2) by a layout
    asyncsgd/  asynchronous SGD: parameter-server shards, leases, bounded staleness
    diloco/    DiLoCo / local SGD: windows of one outer step, membership changes at their ends
"""
