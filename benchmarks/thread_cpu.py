"""CPU time per thread of this machine's Ray processes, from ``/proc`` (Linux), grouped by
what each process is: the driver (this process), elastic_dp's worker actors, the peer's
actors, the raylet, the GCS. ``bench_sync`` takes a reading around each round, so each
system's CPU per step shows where it went: the training threads, gloo's, and Ray's
(worker.io, the gRPC pollers, the raylet, the GCS)."""

from __future__ import annotations

import collections
import os

_HZ = os.sysconf("SC_CLK_TCK")
BUSIEST = "(busiest thread)"
KINDS = {"ray::WorkerActor": "elastic_dp worker", "ray::DDPWorker": "DDP worker"}


def _kind(cmdline: str) -> str | None:
    for prefix, kind in KINDS.items():
        if cmdline.startswith(prefix):
            return kind
    exe = cmdline.split(" ", 1)[0]
    if exe.endswith("/raylet"):
        return "raylet"
    if exe.endswith("/gcs_server"):
        return "gcs"
    return None


def process_threads(pid: int) -> dict[int, tuple[str, float]]:
    """Thread id -> (name, user + system CPU seconds)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(tid)] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / _HZ)
    return found


def reading() -> dict[int, tuple[str, dict[int, tuple[str, float]]]]:
    """Every Ray process of a known kind, and the driver: pid -> (kind, its threads)."""
    kinds = {os.getpid(): "driver"}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                kind = _kind(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
        if kind is not None:
            kinds[int(pid)] = kind
    out = {}
    for pid, kind in kinds.items():
        try:
            out[pid] = (kind, process_threads(pid))
        except OSError:  # the process ended
            continue
    return out


def spent(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """CPU seconds between two readings: kind -> thread name -> seconds (a thread's name
    is its process's unless it set its own: a Python thread shows as its actor's, and Ray
    gives the thread it lent to a call its own name back when the call ends). Under
    ``BUSIEST``, each process's busiest thread (a worker's training thread) again."""
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for pid, (kind, threads) in after.items():
        earlier = before.get(pid, (kind, {}))[1]
        spent_by = {tid: cpu - earlier.get(tid, (name, 0.0))[1] for tid, (name, cpu) in threads.items()}
        for tid, (name, _) in threads.items():
            out[kind][name] += spent_by[tid]
        if spent_by:
            out[kind][BUSIEST] += max(spent_by.values())
    return out
