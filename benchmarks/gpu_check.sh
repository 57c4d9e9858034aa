#!/usr/bin/env bash
# The CUDA path, on a machine with one or more NVIDIA GPUs, in one go (within 10 minutes on
# one GPU): the tests marked cuda (tests/test_cuda.py: a 1-worker NCCL group, two workers
# sharing one GPU through gloo, fused AdamW's step counters on the device through a
# restore, bf16 autocast, pinned-memory batches; a 2-GPU NCCL group where there are 2),
# then benchmarks/bench_gpu.py (the GPT job's step against plain PyTorch on the same GPU,
# model FLOPs utilisation of a GPT that fills the device, and that GPT at ZeRO stage 3
# against stage 0). Prints the figures; the
# JSON also goes to $OUT/bench_gpu.json when OUT is set (each part as it ends). The limits
# come from GPU_TESTS_S, GPU_TEST_S, GPU_BENCH_S and GPU_ROUNDS (below).
#
#   benchmarks/gpu_check.sh            # with the python that has torch (CUDA) and ray
#   PYTHON=.venv/bin/python benchmarks/gpu_check.sh
#
# Where that python has no Ray (the lent GPU machine's image), the wheels that
# benchmarks/gpu_carry.py leaves in .whl/ are installed into /tmp/site first: there,
# carry .whl and run this script.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import ray" 2>/dev/null && ls .whl/ray-*.whl >/dev/null 2>&1; then
  echo "no ray in $PY: installing .whl/ into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 2
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

"$PY" - <<'PYEOF' || exit 2
import importlib.util, sys
import torch
missing = [m for m in ("ray", "safetensors", "pyarrow", "pytest", "pytest_timeout") if importlib.util.find_spec(m) is None]
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)} (install elastic_dp's test extra into this python)")
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU is visible: nothing to check here")
PYEOF

# The limits, in seconds, of the tests (all, and each) and of the benchmark: the defaults fit
# 10 minutes; a lease with less time left sets smaller ones.
TESTS_S="${GPU_TESTS_S:-300}" TEST_S="${GPU_TEST_S:-240}" BENCH_S="${GPU_BENCH_S:-290}"
ROUNDS="${GPU_ROUNDS:-6}"
status=0
nvidia-smi -L 2>&1 | tee "${OUT:-/tmp}/nvidia_smi.log"
timeout "$TESTS_S" "$PY" -m pytest -m cuda -ra -v --timeout "$TEST_S" tests/test_cuda.py 2>&1 \
    | tee "${OUT:-/tmp}/gpu_tests.log" || status=1
timeout "$BENCH_S" "$PY" -m benchmarks.bench_gpu --rounds "$ROUNDS" --steps-per-round 20 --fill-steps-per-round 8 \
    2>&1 | tee "${OUT:-/tmp}/bench_gpu.log" || status=1
exit $status
