"""One exception hierarchy for elastic_dp.

Every message says what went wrong and which setting or input to change, in the words
of the caller: the flag from the ``elastic-dp`` command (``--zero 1``), the field from the
Python API (``TrainConfig.zero=1``). Messages are written with the flags; an error shown
where the API is the caller (``SURFACE``, the default) names the fields instead
(``API_NAMES``). The classes carry only a message, so they pickle cleanly when they cross
from a worker actor to the coordinator, and are shown in the words of the process that
shows them.
"""

from __future__ import annotations

import contextvars
import re

SURFACE: contextvars.ContextVar[str] = contextvars.ContextVar("elastic_dp_surface", default="api")
"""Who is calling: ``api`` (Python) or ``cli`` (``elastic-dp``, which sets it)."""

API_NAMES = {
    "--workers": "ClusterConfig.workers",
    "--inject": "Trainer's inject", "--out": "Trainer's out_dir", "--progress": "Trainer(progress=True)",
    "--no-progress": "Trainer(progress=False)",
}
"""Each ``elastic-dp train`` flag's name in the Python API: the ``Trainer``'s own here, each
config's added from its declarations where the config is defined (``settings.api_names``;
``tests/test_settings.py`` checks them against the command's flags)."""

_WORDS = ("constant", "cosine", "linear", "wsd", "sync", "async", "diloco", "skip", "fail", "cpu", "cuda", "auto", "gloo", "nccl", "bf16", "fp32", "none",
          "inverse", "latest", "never", "local", "global", "flat", "hierarchical", "int8", "int4", "host", "hosts")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)"
                   r"(?: (MIN:MAX|-?\d[\w.]*|'[^']*'|[A-Z][A-Z0-9_]*\b|(?:" + "|".join(_WORDS) + r")\b))?")


def in_api_words(text: str) -> str:
    """``text`` with each flag (and its value) named as the Python API names it."""
    def name(match: re.Match) -> str:
        flag, value = match.group(1), match.group(2)
        api = API_NAMES.get(flag)
        if api is None:
            return match.group(0)
        if value is None:
            return api
        if flag == "--workers" and value == "MIN:MAX":
            return "ClusterConfig(min_workers=MIN, workers=MAX)"
        if "(" in api or "'s " in api:  # a boolean flag, or a Trainer argument: no value follows it
            return f"{api} {value}"
        return f"{api}={value!r}" if value in _WORDS else f"{api}={value}"

    return _FLAG.sub(name, text)


class ElasticDPError(Exception):
    """Base class of every error elastic_dp raises on purpose."""

    def __str__(self) -> str:
        text = super().__str__()
        return in_api_words(text) if SURFACE.get() == "api" else text


class ConfigError(ElasticDPError, ValueError):
    """A setting is invalid; the message names the setting (or CLI flag) to change."""


class TaskError(ElasticDPError):
    """The task (job module, model, dataset, loss or optimizer factory) is unusable."""


class ClusterError(ElasticDPError):
    """The Ray cluster cannot be reached; the message names the address and the setting."""


class PlacementError(ElasticDPError):
    """The cluster cannot place the requested workers within the placement timeout."""


class MembershipError(ElasticDPError):
    """The run cannot keep enough workers alive; the message says what to change."""


class Interrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C: SIGINT): the message says where it stopped, the
    latest checkpoint and how to go on from it. Its workers are stopped and no partial
    checkpoint is left. A ``KeyboardInterrupt``, not an error: code that catches Ctrl-C
    still does, and ``except Exception`` does not swallow it."""

    def __str__(self) -> str:
        text = super().__str__()
        return in_api_words(text) if SURFACE.get() == "api" else text


class NonFiniteError(ElasticDPError):
    """Steps had a non-finite loss or gradient (no update was applied); the message names
    the step, the ranks and the setting (``--on-nonfinite``, ``--max-nonfinite-steps``)."""


class CheckpointError(ElasticDPError):
    """A checkpoint cannot be written, found, or trusted (missing file, bad checksum)."""


class WorkerError(ElasticDPError):
    """A worker failed a step; carries the worker's rank, the step and its error text."""

    def __init__(self, message: str, *, rank: int = -1, step: int = -1) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step

    def __reduce__(self):  # keep keyword fields (and the subclass) across the Ray actor boundary
        return (_rebuild_worker_error, (type(self), self.args[0] if self.args else "", self.rank, self.step))


def _rebuild_worker_error(cls: type, message: str, rank: int, step: int) -> "WorkerError":
    return cls(message, rank=rank, step=step)


class CollectiveError(WorkerError):
    """A step's collective failed on a healthy worker: a peer died or hung, or the group
    was aborted. Recoverable: the survivors re-form the group and re-run the step."""


def peer_error(exc: BaseException) -> str:
    """What a failed collective says, without the backend's source path and its advice:
    gloo's ``[/__w/pytorch/.../pair.cc:537] Read error [127.0.0.1]:12183: Connection reset
    by peer. This is typically caused by ... GLHF! ...`` becomes ``Read error
    [127.0.0.1]:12183: Connection reset by peer``."""
    text = str(exc).strip()
    if text.startswith("[") and "] " in text and ("/" in text.split("] ", 1)[0] or ".cc:" in text.split("] ", 1)[0]):
        text = text.split("] ", 1)[1]  # the C++ source location
    for advice in (". This is typically caused by", " This is typically caused by"):
        text = text.split(advice, 1)[0]
    return text.rstrip(".")


class StorageError(CheckpointError):
    """Storage (``--checkpoint-dir``, ``--storage``, an ``--out`` URI) cannot be opened,
    reached, read or written; the message names the location and the setting."""
