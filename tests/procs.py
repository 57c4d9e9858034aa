"""Worker actor processes on this machine, seen from outside the program (/proc)."""

from __future__ import annotations

import os


def worker_pids() -> list[int]:
    """PIDs of the processes running an elastic_dp worker actor of this test process's Ray
    cluster (its descendants: the suite's other process has a cluster of its own)."""
    ours = set(descendants(os.getpid()))
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) in ours and b"WorkerActor" in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(int(pid))
        except OSError:
            pass
    return sorted(found)


def cmdline(pid: int) -> str:
    """The command line of ``pid`` ('' when it is gone)."""
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """PIDs of every process below ``root`` in the process tree."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # the name may hold spaces and parens
        children.setdefault(parent, []).append(int(pid))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return sorted(found)


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
