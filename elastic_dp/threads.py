"""Names for this package's threads where the operating system shows them.

Python's thread names stay inside Python: ``top -H``, py-spy's native view and
``/proc/<pid>/task/*/comm`` (which ``benchmarks/thread_cpu.py`` reads) show every thread
of a worker under its process's name. ``set_os_name`` gives the calling thread a name
there too (Linux, up to 15 bytes; elsewhere it does nothing).
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def set_os_name(name: str) -> None:
    if _libc is not None:
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
