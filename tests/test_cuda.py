"""The CUDA path, on a machine with an NVIDIA GPU: NCCL groups, two workers sharing one
GPU through gloo with CUDA tensors (NCCL refuses two ranks on one device), pinned-memory
prefetch, bf16 autocast on CUDA, and Adam's step counters on the device. Each run ends
where a plain PyTorch replay on the same GPU ends.

Marked ``cuda``; without a GPU every test is skipped and says why (``-ra`` prints it).
``benchmarks/gpu_check.sh`` runs them with the step benchmark on a GPU machine.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from tests.reference import max_abs_diff, replay
from tests.tasks import TINY_GPT_TASK

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA GPU is visible to torch: the CUDA path is tested on a GPU "
                                        "machine (benchmarks/gpu_check.sh)")]

TOL = 2e-5  # AdamW, 6 steps: float32 summation order moves it about 2e-6 on CPUs (tests.noise); on one
# H200 (2026-12-04) every test passed within it, the figures not recorded: record them at the next lease


def _fused_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW whose step counters live on the GPU (fused), unlike the default's on the CPU."""
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)


def _run(tmp_path, cluster: ClusterConfig, *, task=TINY_GPT_TASK, inject=(), checkpoint=None, **train):
    config = dataclasses.replace(task.defaults, steps=6, **train)
    summary = Trainer(task, train=config, cluster=cluster, checkpoint=checkpoint, out_dir=str(tmp_path),
                      progress=False, inject=list(inject)).fit()
    expected = replay(task, config, str(tmp_path / "initial.safetensors"),
                      device="cuda")
    return summary, max_abs_diff(load_file(tmp_path / "final.safetensors"), expected)


@pytest.mark.parametrize("zero", [0, 2])
def test_one_worker_on_an_nccl_group_ends_where_the_gpu_replay_ends(ray_cluster, tmp_path, zero):
    summary, diff = _run(tmp_path, ClusterConfig(workers=1, device="cuda"), zero=zero)
    assert diff < TOL
    assert summary.steps == 6


@pytest.mark.parametrize("zero", [1, 2])
def test_two_workers_share_one_gpu_through_gloo_and_survive_a_kill(ray_cluster, tmp_path, zero):
    cluster = ClusterConfig(workers=2, min_workers=1, device="cuda", gpus_per_worker=0.5)
    assert cluster.backend_for("cuda") == "gloo"
    summary, diff = _run(tmp_path, cluster, inject=["kill:step=3:rank=1"], zero=zero)
    assert diff < TOL
    assert summary.steps == 6


def test_adam_step_counters_on_the_device_survive_a_restore_from_the_checkpoint(ray_cluster, tmp_path):
    """The only worker is killed in step 4: its replacement loads the step-3 checkpoint,
    fused AdamW's step counters (on the GPU) included."""
    task = dataclasses.replace(TINY_GPT_TASK, optimizer=_fused_adamw)
    checkpoint = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=3, asynchronous=False)
    summary, diff = _run(tmp_path / "out", ClusterConfig(workers=1, device="cuda"), task=task,
                         checkpoint=checkpoint, inject=["kill:step=4:rank=0"])
    assert diff < TOL
    assert "restored_from_checkpoint" in summary.render()


def test_bf16_autocast_on_cuda_tracks_the_replay(ray_cluster, tmp_path):
    """bf16 matmuls round differently in other layouts, so compare whole updates, as the
    CPU bf16 tests do: within 5% (L2) of the replay's update."""
    cluster = ClusterConfig(workers=1, device="cuda")
    config = dataclasses.replace(TINY_GPT_TASK.defaults, steps=4, precision="bf16")
    Trainer(TINY_GPT_TASK, train=config, cluster=cluster, out_dir=str(tmp_path), progress=False).fit()
    initial = load_file(tmp_path / "initial.safetensors")
    expected = replay(TINY_GPT_TASK, config, str(tmp_path / "initial.safetensors"), device="cuda")
    final = load_file(tmp_path / "final.safetensors")

    def flat(state):
        return torch.cat([state[k].float().cpu().flatten() for k in sorted(state)])

    update = flat(expected) - flat(initial)
    assert float((flat(final) - flat(expected)).norm() / update.norm()) < 0.05


def test_batches_are_prepared_ahead_in_pinned_memory():
    from elastic_dp.config import TrainConfig
    from elastic_dp.modes.sync.program import SyncProgram
    from elastic_dp.worker.replica import Replica

    replica = Replica(TINY_GPT_TASK, TrainConfig(global_batch=8), torch.device("cuda", 0), group=None)

    program = SyncProgram(replica)
    assert program.prefetch  # on by default on a GPU
    (samples, batch), = replica.collate(torch.arange(8).numpy())
    tensors = batch if isinstance(batch, (list, tuple)) else [batch]
    assert samples == 8 and all(t.is_pinned() for t in tensors if isinstance(t, torch.Tensor))


def test_async_with_parameter_servers_on_the_gpu_ends_where_the_gpu_replay_ends(ray_cluster, tmp_path):
    """--mode async, staleness 0 (so it equals the synchronous replay), two shards on the
    GPU beside one worker that takes half of it."""
    cluster = ClusterConfig(workers=1, device="cuda", gpus_per_worker=0.5)
    summary, diff = _run(tmp_path, cluster, mode="async", max_staleness=0, ps_shards=2, ps_device="cuda")
    assert diff < TOL
    assert summary.steps == 6


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL group of 2 ranks needs 2 GPUs")
@pytest.mark.parametrize("zero", [0, 1, 2])  # stage 1 reduce-scatters in place on NCCL
def test_a_kill_on_a_two_gpu_nccl_group_reforms_in_place(ray_cluster, tmp_path, zero):
    cluster = ClusterConfig(workers=2, min_workers=1, device="cuda")
    summary, diff = _run(tmp_path, cluster, inject=["kill:step=2:rank=1:phase=allreduce"], zero=zero)
    assert diff < TOL
    assert summary.steps == 6


@pytest.mark.parametrize("gpus", [1, 2])
def test_global_batch_statistics_on_the_gpu_end_where_the_gpu_replay_ends(ray_cluster, tmp_path, gpus):
    """--batch-stats global on CUDA tensors, through a kill: two workers sharing one GPU
    (gloo, staged through the host), or one GPU each (NCCL; needs two)."""
    if gpus > torch.cuda.device_count():
        pytest.skip(f"an NCCL group of 2 ranks needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    from tests.tasks import CNN_TASK

    cluster = ClusterConfig(workers=2, min_workers=1, device="cuda", gpus_per_worker=1.0 if gpus == 2 else 0.5)
    summary, diff = _run(tmp_path, cluster, task=CNN_TASK, inject=["kill:step=3:rank=1"], batch_stats="global")
    assert diff < 1e-5  # SGD, as tests/test_buffers.py (9.5e-7 there on CPUs); passed on the H200
    assert summary.steps == 6
