"""ZeRO stage 3 reaches the parameters torch's FSDP2 (``fully_shard``) reaches on the same
batches.

FSDP2 runs in two plain processes (torch.multiprocessing, gloo, a FileStore), the tiny
GPT's blocks and then the whole model each ``fully_shard``-ed, the way its users write it;
each rank trains the contiguous slice of every global batch that elastic_dp gives its
rank: 13 samples a step, so 7 and 6. FSDP2 averages the gradients over the ranks, so each
rank's loss is scaled by its share of the batch times the world size: the average is then
elastic_dp's sum over the global batch divided by B. Gradient clipping (over FSDP2's
DTensors) and the learning-rate rule of the task's configuration are the same. Tolerance:
stage 0's over 6 AdamW steps (2e-5; float32 order noise, ~2e-6 measured).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from elastic_dp import ElasticSampler
from elastic_dp.data import split
from tests.reference import max_abs_diff
from tests.tasks import TINY_GPT_TASK
from tests.zero_runs import initial_weights, train

TOL = 2e-5  # float32 order; worst measured 1.1e-06 (3 tests here, 3 suite runs on 2026-12-04,
# python -m tests.noise; thread ranks: the same figure in each run): 18x margin

WORLD = 2
CONFIG = dataclasses.replace(TINY_GPT_TASK.defaults, steps=6, global_batch=13, micro_batch=None)


def _fsdp2_rank(rank: int, store_path: str, initial: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    task, config = TINY_GPT_TASK, CONFIG
    model = task.model()
    model.load_state_dict(load_file(initial))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    _train_and_save(model, rank, config.steps, out)
    dist.destroy_process_group()
    os._exit(0)  # as the DDP reference (test_ddp_reference.py): no teardown of gloo's threads at exit


def _train_and_save(model: torch.nn.Module, rank: int, steps: int, out: str) -> None:
    """The FSDP2 peer's loop, each rank over its contiguous slice of the sampler's steps,
    and the whole state dict written by rank 0. The loss is elastic_dp's scale (the slice's
    share of the batch) times the world size, which FSDP2's average divides back out."""
    task, config = TINY_GPT_TASK, CONFIG
    dataset = task.dataset()
    optimizer = task.optimizer(model)
    base = [g["lr"] for g in optimizer.param_groups]
    sampler = ElasticSampler(len(dataset), global_batch=config.global_batch, seed=config.seed)
    for step in range(steps):
        mine = split(sampler.batch(step), WORLD)[rank]
        optimizer.zero_grad()
        loss = task.loss(model, task.collate([dataset[int(i)] for i in mine]))
        (loss * (len(mine) / config.global_batch) * WORLD).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * config.lr_factor(step)
        optimizer.step()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if rank == 0:
        save_file({k: v.detach().clone() for k, v in state.items()}, out)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("fsdp2")
    initial = initial_weights(TINY_GPT_TASK, CONFIG.seed)
    save_file(initial, tmp / "initial.safetensors")
    mp.start_processes(_fsdp2_rank, args=(str(tmp / "store"), str(tmp / "initial.safetensors"),
                                          str(tmp / "fsdp2.safetensors")), nprocs=WORLD, start_method="spawn")
    return initial, load_file(tmp / "fsdp2.safetensors")


@pytest.mark.parametrize("settings", [{}, {"reshard_after_forward": False}, {"activation_checkpointing": True}],
                         ids=["reshard", "keep", "activation-checkpointing"])
def test_stage_3_reaches_fsdp2_s_parameters(fsdp2, settings):
    initial, theirs = fsdp2
    assert [len(s) for s in split(np.arange(CONFIG.global_batch), WORLD)] == [7, 6]  # uneven
    ours, _, _ = train(TINY_GPT_TASK, dataclasses.replace(CONFIG, zero=3, **settings), WORLD, range(CONFIG.steps),
                       initial)
    assert max_abs_diff(ours, initial) > 1e-3
    print(f"stage 3 vs FSDP2: {max_abs_diff(ours, theirs):.2e}")
    assert max_abs_diff(ours, theirs) < TOL


# -- bf16 gathers with fp32 exceptions (--param-dtype bf16 --keep-fp32) -------------------------
KEPT = "*ln*"  # the layer norms (and the final one) stay fp32 whole
MIXED_STEPS = 1
BF16_TOL = 1e-3
# one AdamW step, whose first update is ±lr (1.5e-3 here) wherever a gradient is not zero: bf16's
# rounding flips a few signs. Measured (one run each, deterministic, 2026-12-06): against FSDP2's
# bf16 4.9e-4, against the fp32 run 3.0e-3 (FSDP2's bf16 too); after 2 steps 2.0e-3 and 4.8e-3,
# after 6 AdamW's amplification makes the envelopes one (1.1e-2 and 8.4e-3)


def _fsdp2_mixed_rank(rank: int, store_path: str, initial: str, out: str, dtypes: str, steps: int) -> None:
    """FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on each block
    and the model, and on each layer norm its own ``fully_shard`` with fp32 parameters whose
    output is cast back to bf16 (``output_dtype``): the policies ``--param-dtype bf16
    --keep-fp32 '*ln*'`` mean. Rank 0 records the dtypes the parameters have in the forward."""
    import fnmatch
    import json

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    task = TINY_GPT_TASK
    model = task.model()
    model.load_state_dict(load_file(initial))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
    for name, module in model.named_modules():
        if name and fnmatch.fnmatchcase(name, KEPT):
            fully_shard(module, mp_policy=fp32)
    for block in model.blocks:
        fully_shard(block, mp_policy=bf16)
    fully_shard(model, mp_policy=bf16)
    seen: dict[str, str] = {}
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda m, _a, name=name: seen.update(
            {f"{name}.{n}" if name else n: str(p.dtype) for n, p in m.named_parameters(recurse=False)}))
    _train_and_save(model, rank, steps, out)
    if rank == 0:
        with open(dtypes, "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()
    os._exit(0)


def test_bf16_gathers_with_fp32_layer_norms_reach_fsdp2_with_the_same_policies(tmp_path):
    """``--zero 3 --param-dtype bf16 --keep-fp32 '*ln*'`` against FSDP2 with the same
    per-module policies in its own processes: the layer norms' parameters are fp32 in the
    forward and every other parameter bf16 (a probe on each module, in both), the final
    weights are fp32 (the masters), within the bf16 envelope of FSDP2's, and both are far
    from the fp32 run (bf16 really computes)."""
    import json

    initial = initial_weights(TINY_GPT_TASK, CONFIG.seed)
    save_file(initial, tmp_path / "initial.safetensors")
    mp.start_processes(_fsdp2_mixed_rank, args=(str(tmp_path / "store"), str(tmp_path / "initial.safetensors"),
                                                str(tmp_path / "fsdp2.safetensors"), str(tmp_path / "dtypes.json"),
                                                MIXED_STEPS),
                       nprocs=WORLD, start_method="spawn")
    theirs, their_dtypes = load_file(tmp_path / "fsdp2.safetensors"), json.loads((tmp_path / "dtypes.json").read_text())
    seen: dict[str, str] = {}

    def probe(replica) -> None:
        if replica.group.rank == 0:
            for name, module in replica.model.named_modules():
                module.register_forward_pre_hook(lambda m, _a, name=name: seen.update(
                    {f"{name}.{n}" if name else n: str(p.dtype) for n, p in m.named_parameters(recurse=False)}))

    config = dataclasses.replace(CONFIG, steps=MIXED_STEPS, zero=3, param_dtype="bf16", keep_fp32=KEPT)
    ours, _, _ = train(TINY_GPT_TASK, config, WORLD, range(MIXED_STEPS), initial, after_build=probe)
    fp32, _, _ = train(TINY_GPT_TASK, dataclasses.replace(config, param_dtype="fp32", keep_fp32=None), WORLD,
                       range(MIXED_STEPS), initial)
    kept = {n for n in seen if "ln" in n}
    assert kept and all(seen[n] == "torch.float32" for n in kept), seen
    assert all(seen[n] == "torch.bfloat16" for n in seen if n not in kept), seen
    assert seen == their_dtypes
    assert all(v.dtype == torch.float32 for v in ours.values())
    diff, apart = max_abs_diff(ours, theirs), max_abs_diff(ours, fp32)
    print(f"bf16 stage 3 vs FSDP2's bf16: {diff:.2e}; vs the fp32 run: {apart:.2e}")
    assert diff < BF16_TOL
    assert apart > 2 * BF16_TOL
