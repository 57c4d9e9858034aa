"""Wheels for the GPU machine: what ``benchmarks/gpu_check.sh`` needs there and its image
lacks, small enough to travel with the repository (64 MiB in all).

The device's image has PyTorch with CUDA, pytest, safetensors, pyarrow, matplotlib and
tensorboard, but not Ray (``/work/.library/device/KINDS.md``). Its Python is 3.12 on
x86-64 and it reaches no package registry, so Ray comes as a wheel. Ray's wheel is
about 79 MB, too large to travel, and 32 MB of it is the Java worker's jar
(``ray/jars``), which a Python-only run never loads. This script runs here:

1. it downloads the Ray release installed here, as the cp312 manylinux wheel, and the
   packages Ray needs that the image does not have (jsonschema and what it needs);
2. it writes the Ray wheel again without ``ray/jars``, RLlib, Serve, the LLM libraries
   and the dashboard's web client, and drops their lines from the wheel's RECORD;
3. it leaves everything in ``.whl/`` and ignores that folder in ``.git/info/exclude``.

It then prints the total size. On the device, a run names ``.whl`` in ``carry``, and
``gpu_check.sh`` installs the wheels into ``/tmp/site`` when ``import ray`` fails.

    .venv/bin/python -m benchmarks.gpu_carry                  # then run gpu_check.sh there
    .venv/bin/python -m benchmarks.gpu_carry --python-version 3.11 --out /tmp/whl311
                                                              # the same for this machine, to try it
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]
EXTRA = ["jsonschema", "jsonschema-specifications", "referencing", "rpds-py"]
"""Ray's requirements that the device image lacks (the rest are there)."""
DROPPED = ("ray/jars/", "ray/rllib/", "ray/serve/", "ray/llm/", "ray/dashboard/client/build/")
"""Parts of Ray that a run of elastic_dp does not load."""
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


def download(names: list[str], python_version: str, out: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(out)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + names, check=True)


def strip(wheel: Path) -> Path:
    """``wheel`` written again without ``DROPPED`` (entries keep their permission bits, so
    Ray's raylet and GCS server stay executable); the original is removed."""
    stripped = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if info.filename.startswith(DROPPED):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(DROPPED)).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    wheel.unlink()
    return stripped.rename(wheel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default="3.12", help="the device's Python (3.12)")
    parser.add_argument("--out", default=str(ROOT / ".whl"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()  # one version of each: two would stop the install there
    download([f"ray=={ray.__version__}", *EXTRA], args.python_version, out)
    wheel = next(out.glob("ray-*.whl"))
    before = wheel.stat().st_size
    strip(wheel)
    if out.resolve() == (ROOT / ".whl").resolve():
        exclude = ROOT / ".git" / "info" / "exclude"
        exclude.parent.mkdir(parents=True, exist_ok=True)
        if "/.whl/" not in (exclude.read_text().split() if exclude.exists() else []):
            with exclude.open("a") as f:
                f.write("/.whl/\n")
    total = sum(w.stat().st_size for w in out.glob("*.whl"))
    print(f"{wheel.name}: {before / 2**20:.1f} MiB -> {wheel.stat().st_size / 2**20:.1f} MiB")
    print(f"{out}: {len(list(out.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB "
          "(the repository's own files travel too: 64 MiB in all)")


if __name__ == "__main__":
    main()
