"""Leave notices that travel through the Ray cluster's key-value store (the GCS).

Two kinds of notice are written there: a worker sent SIGTERM announces itself
(``SigtermLeave``), and ``elastic-dp release`` asks for the workers on a node, or for
given worker actors, to be let go (the workers ready when it was written: a replacement
placed there later stays). The coordinator's pool reads them with Ray's own drain
notices (``control.membership.pool.WorkerPool.leave_notices``) and lets the workers go at
a step boundary. Keys are ``leave:actor:<actor id>`` and ``leave:node:<node id>`` in the
``elastic_dp`` namespace; the value is the notice as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Callable

from elastic_dp.messages import LeaveNotice

logger = logging.getLogger(__name__)

NAMESPACE = "elastic_dp"
PREFIX = "leave:"
NOTICE_POLL_S = 0.2
"""How often the driver asks the GCS for notices (Ray's drains, and these): two small RPCs,
at most this often, from the coordinator's step boundaries and wake-ups."""


def notice_key(kind: str, ident: str) -> str:
    """The key of a notice about an ``actor`` or a ``node``."""
    return f"{PREFIX}{kind}:{ident}"


def announce(kind: str, ident: str, notice: LeaveNotice) -> None:
    """Write ``notice`` about the ``actor`` or ``node`` ``ident`` (this process must be connected to Ray)."""
    from ray.experimental import internal_kv
    value = json.dumps({"source": notice.source, "cause": notice.cause, "deadline": notice.deadline,
                        "issued": time.time()})
    internal_kv._internal_kv_put(notice_key(kind, ident), value, overwrite=True, namespace=NAMESPACE)


def read_notices() -> dict[str, LeaveNotice]:
    """Every notice written so far, by key (``leave:actor:…``, ``leave:node:…``)."""
    from ray.experimental import internal_kv
    keys = internal_kv._internal_kv_list(PREFIX, namespace=NAMESPACE)
    notices = {}
    for key in keys:
        value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if value is None:
            continue
        fields = json.loads(value)
        notices[key.decode() if isinstance(key, bytes) else key] = LeaveNotice(
            fields["source"], fields["cause"], fields.get("deadline"), fields.get("issued"))
    return notices


def draining_nodes() -> dict[str, float | None]:
    """The nodes Ray is draining, with their deadlines (Unix seconds; None: no deadline),
    from ``ray._private.state.state.get_draining_nodes()`` (what Ray Train v2's watcher reads)."""
    import ray
    return {node: ms / 1000 or None for node, ms in ray._private.state.state.get_draining_nodes().items()}


def forget_notices(keys: list[str]) -> None:
    """Delete notices that were acted on (the workers they named are gone)."""
    from ray.experimental import internal_kv
    for key in keys:
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)


class SigtermLeave:
    """A worker's SIGTERM, turned into a request to leave at the next step boundary.

    The handler (installed from the actor's main thread, where Ray runs ``__init__``)
    only records the notice and starts a thread that calls ``on_notice`` (which announces
    it and asks the step loop to stop after its step) and, ``grace_s`` later, exits the
    process if the coordinator has not let it go by then. A second SIGTERM changes nothing."""

    def __init__(self, grace_s: float, on_notice: Callable[[LeaveNotice], None],
                 exit: Callable[[int], None] = os._exit) -> None:
        self.grace_s, self.on_notice, self._exit = grace_s, on_notice, exit
        self.notice: LeaveNotice | None = None
        self.ending = False
        """The driver is stopping this worker (its run ended): a SIGTERM now is that, not a
        notice to leave, and ends the process without a word."""
        self.installed = threading.current_thread() is threading.main_thread()
        if self.installed:
            signal.signal(signal.SIGTERM, self._handle)
        else:  # not reached under Ray (``__init__`` runs on the main thread); a caller in a thread keeps its own
            logger.warning("SIGTERM is not handled as a leave: the worker was built off the main thread")

    def _handle(self, signum: int, frame: object) -> None:
        if self.ending:
            self._exit(0)
            return  # (an exit that returns: the tests')
        if self.notice is not None:
            return
        self.notice = LeaveNotice("signal", f"SIGTERM to worker process {os.getpid()}", time.time() + self.grace_s)
        threading.Thread(target=self._leave, name="elastic-dp-leave", daemon=True).start()

    def _leave(self) -> None:
        try:
            self.on_notice(self.notice)
        except Exception:  # the notice still ends the process at the deadline
            logger.exception("announcing the leave failed")
        time.sleep(max(0.0, self.notice.deadline - time.time()))
        logger.warning("%s: not let go within --leave-grace %.0f s; exiting", self.notice.cause, self.grace_s)
        self._exit(0)
