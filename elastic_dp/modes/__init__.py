"""Training modes: how a run trains, chosen once from the configuration.

A mode is one package here: its settings (``settings.py``, which names the two halves),
its driver half (``mode.py``, which the coordinator drives through ``TrainingMode``,
``.base``, never branching on which one it has; built from the run's ``ModeContext``,
``.context``) and its worker half (``program.py``, a ``Program``, ``.program``, which the
worker actor reaches through its ``call`` and ``stream`` entry points). Adding one is its
package and one line in ``config.MODES``.

    sync/      synchronous data parallelism: one collective group per generation, the state
               replicated (ZeRO-0) or sharded (ZeRO-1/2/3) by a layout
    asyncsgd/  asynchronous SGD: parameter-server shards, leases, bounded staleness
    diloco/    DiLoCo / local SGD: windows of one outer step, membership changes at their ends
"""
