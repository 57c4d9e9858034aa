#!/usr/bin/env python3
"""Set up and run elastic_dp on a fresh machine that has only python3 and pip.

    python3 dev.py demo     # train the small GPT on 2 CPU workers (embedded local Ray)
    python3 dev.py test     # run the test suite (extra arguments go to pytest)

The first call creates ``.venv/`` inside the repository and installs the project with
its dependencies (with uv, which pip installs into the venv first; pip itself if that
fails); later calls reuse it (the install is redone only when ``pyproject.toml``
changes). On a machine without an NVIDIA GPU the CPU build of torch is preferred: a
local wheel when pip's ``find-links`` has one, otherwise PyTorch's CPU index, so no
multi-GB CUDA build is downloaded.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".elastic_dp-installed"
TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _has_nvidia_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


def _local_cpu_torch_wheel() -> str | None:
    links = os.environ.get("PIP_FIND_LINKS", "")
    for conf in ("/etc/pip.conf", os.path.expanduser("~/.config/pip/pip.conf"), os.path.expanduser("~/.pip/pip.conf")):
        if os.path.exists(conf):
            for line in Path(conf).read_text().splitlines():
                if line.strip().startswith("find-links"):
                    links += " " + line.split("=", 1)[1]
    version = TORCH_PIN.split("==")[1]
    for folder in links.split():
        folder = folder.removeprefix("file://")
        hits = glob.glob(os.path.join(folder, f"torch-{version}+cpu-*.whl"))
        if hits:
            return hits[0]
    return None


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def _install(py: str, *args: str) -> None:
    """Install into the venv with uv (installed into it by pip), which downloads and
    compiles in parallel, about 3x faster than pip here (28 s against 86 s for everything);
    with pip when uv cannot be installed or fails. Bytecode is compiled at install time
    either way: where PYTHONDONTWRITEBYTECODE is set, nothing would be cached later, and
    every test process would compile torch and Ray from source."""
    try:
        if subprocess.run([py, "-m", "uv", "--version"], capture_output=True).returncode:
            _run([py, "-m", "pip", "install", "--quiet", "uv"])
        _run([py, "-m", "uv", "pip", "install", "--python", py, "--compile-bytecode", *args])
    except subprocess.CalledProcessError:
        print("uv failed: installing with pip", flush=True)
        _run([py, "-m", "pip", "install", *args])


def _create_venv() -> None:
    try:
        _run([sys.executable, "-m", "venv", str(VENV)])
    except subprocess.CalledProcessError:
        # Debian's python3 without python3-venv: virtualenv from pip does the same job.
        shutil.rmtree(VENV, ignore_errors=True)
        _run([sys.executable, "-m", "pip", "install", "--user", "virtualenv"])
        _run([sys.executable, "-m", "virtualenv", str(VENV)])


def ensure_env() -> Path:
    """Create the virtual environment and install the project once; return its python."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if _venv_python().exists() and STAMP.exists() and STAMP.read_text() == digest:
        return _venv_python()
    if not _venv_python().exists():
        _create_venv()
    py = str(_venv_python())
    if not _has_nvidia_gpu():
        wheel = _local_cpu_torch_wheel()
        if wheel:
            _install(py, wheel)
        else:
            _install(py, TORCH_PIN, "--extra-index-url", CPU_INDEX)
    _install(py, "-e", ".[test]")
    STAMP.write_text(digest)
    return _venv_python()


def _parallel(args: list[str]) -> list[str]:
    """pytest-xdist's options: one test process per core, at most 2, unless the caller chose
    (``-n``, ``--numprocesses``, ``-p no:xdist``). The suite is CPU-bound on a 2-core machine
    (torch's import and the optimizer's first build in every worker actor): two processes
    fill the cores that one leaves idle while its tests wait on deadlines, heartbeats and
    subprocesses (README, "The tests come in two tiers")."""
    if any(a.startswith(("-n", "--numprocesses", "--dist")) or a == "no:xdist" for a in args):
        return []
    cores = min(2, os.cpu_count() or 1)
    return ["-n", str(cores), "--dist", "worksteal"] if cores > 1 else []


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "setup"):
        print(__doc__)
        return 2
    py = str(ensure_env())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if argv[0] == "setup":
        return 0
    if argv[0] == "demo":
        cmd = [py, "-m", "elastic_dp.cli", "train", "jobs.gpt", "--workers", "2",
               "--steps", "300", "--out", "runs/demo", *argv[1:]]
    else:
        cmd = [py, "-m", "pytest", *_parallel(argv[1:]), *argv[1:]]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
