"""``--compress powersgd`` against its oracles: torch's own ``powerSGD_hook`` under DDP on the
same batches, and the replay contract (PowerSGD applied to the global gradient with one
error buffer, ``tests.reference.PowerSGDContract``) at 1, 2 and 3 workers and through a
checkpoint saved at 3 and resumed at 2. Each compressed run is far from the uncompressed
one (it really compresses). The ranks are threads on gloo (no Ray) but for the DDP peer,
which runs in two processes of its own; a join on a Ray cluster is in test_compression_ray."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from elastic_dp import ElasticSampler, TrainConfig
from elastic_dp.comm.compression import PowerSGDSpec, parse_compress
from elastic_dp.durable.checkpoint import CheckpointStore, manifest_of, write_part
from elastic_dp.errors import ConfigError
from tests.reference import max_abs_diff, replay
from tests.tasks import MLP_TASK, TINY_GPT_TASK
from tests.zero_runs import initial_weights, train

GPT_TOL = 2e-5  # float32 order: 12 AdamW steps of the tiny GPT, N = 1, 2, 3 against the contract
# measured 2.7e-6 to 4.0e-6 (one run each, 2026-12-06): 5x margin; compression moves it 3.1e-2
MLP_TOL = 1e-6  # 12 SGD steps of the MLP: measured 1.0e-7 to 1.3e-7 against the contract and 9.7e-8
# against torch's hook (one run each, 2026-12-06): 7x margin; compression moves it 2.6e-2
COMPRESSED_APART = 1e-2  # the compressed run differs from the uncompressed one by more than this


def _save(weights: dict, path) -> str:
    save_file(weights, str(path))
    return str(path)


@pytest.mark.parametrize("task,spec,tol", [(TINY_GPT_TASK, "powersgd:rank=2:start=2", GPT_TOL),
                                           (MLP_TASK, "powersgd:rank=1:start=2", MLP_TOL)], ids=["gpt", "mlp"])
def test_powersgd_at_any_worker_count_reaches_the_replay_of_its_contract(tmp_path, task, spec, tol):
    config = dataclasses.replace(task.defaults, steps=12, compress=spec)
    initial = initial_weights(task, config.seed)
    path = _save(initial, tmp_path / "initial.safetensors")
    contract = replay(task, config, path)
    assert max_abs_diff(contract, replay(task, dataclasses.replace(config, compress=None), path)) > COMPRESSED_APART
    for world in (1, 2, 3):
        weights, _, _ = train(task, config, world, range(12), initial)
        assert max_abs_diff(weights, contract) < tol, world


@pytest.mark.parametrize("zero", [1, 2])
def test_powersgd_at_zero_1_and_2_reaches_the_replay_of_stage_0s_contract(tmp_path, zero):
    """ZeRO stages 1 and 2 reduce-scatter: the factors are all-reduced whole, each rank keeps
    its chunk of the approximation, and the contract is stage 0's (measured 2.6e-6 at 2
    workers, 2.9e-6 at 3, one run each, 2026-12-06)."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=12, compress="powersgd:rank=2:start=2")
    initial = initial_weights(task, config.seed)
    contract = replay(task, config, _save(initial, tmp_path / "initial.safetensors"))
    for world in (2, 3):
        weights, _, _ = train(task, dataclasses.replace(config, zero=zero), world, range(12), initial)
        assert max_abs_diff(weights, contract) < GPT_TOL, world


@pytest.mark.parametrize("zero", [0, 2])
def test_a_checkpoint_saved_at_3_workers_resumes_at_2_on_the_replay(tmp_path, zero):
    """Each rank's error is a row of ``reduction/error/<bucket>``; at another world size the
    rows are summed into one rank's, so that the errors' sum (all the contract keeps) goes on
    (at ZeRO-2 the rows are the buckets padded to 3, cut to their padding at 2)."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=12, compress="powersgd:rank=2:start=2", zero=zero)
    initial = initial_weights(task, config.seed)
    contract = replay(task, config, _save(initial, tmp_path / "initial.safetensors"))
    parts: dict = {}
    train(task, config, 3, range(6), initial, parts=parts)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    directory = store.begin(6)
    reports = [write_part(store.storage, directory, parts[r]) for r in range(3)]
    checkpoint = store.commit(directory, manifest_of(reports, step=6, sampler={"seed": config.seed}, world_size=3))
    rows = [k for k in checkpoint.manifest["tensors"] if k.startswith("optim/reduction/error/")]
    assert rows and all(checkpoint.manifest["tensors"][k]["shape"][0] == 3 for k in rows)
    resumed, _, _ = train(task, config, 2, range(6, 12), None, start=checkpoint)
    assert max_abs_diff(resumed, contract) < GPT_TOL
    # the factors and the step count alone, without the errors, would not be
    def drop_errors(replica) -> None:
        reduction = replica.strategy.reduction
        load = reduction.load_rows
        reduction.load_rows = lambda rows, rank, world: load(
            {k: v for k, v in rows.items() if not k.startswith("error/")}, rank, world)

    without, _, _ = train(task, config, 2, range(6, 12), None, start=checkpoint, after_build=drop_errors)
    assert max_abs_diff(without, contract) > 10 * GPT_TOL


# -- torch's own hook under DDP -------------------------------------------------------------
def _ddp_rank(rank: int, store: str, initial: str, out: str, spec: PowerSGDSpec, steps: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    task, config = MLP_TASK, MLP_TASK.defaults
    model = task.model()
    model.load_state_dict(load_file(initial))
    ddp = DDP(model)
    ddp.register_comm_hook(PowerSGDState(process_group=None, matrix_approximation_rank=spec.rank,
                                         start_powerSGD_iter=spec.start, min_compression_rate=spec.min_ratio,
                                         random_seed=config.seed), powerSGD_hook)
    dataset, optimizer = task.dataset(), task.optimizer(model)
    base = [g["lr"] for g in optimizer.param_groups]
    sampler = ElasticSampler(len(dataset), global_batch=config.global_batch, seed=config.seed)
    for step in range(steps):
        mine = np.array_split(sampler.batch(step), 2)[rank]
        optimizer.zero_grad()
        task.loss(ddp, task.collate([dataset[int(i)] for i in mine])).backward()
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * config.lr_factor(step)
        optimizer.step()
    if rank == 0:
        save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
    dist.destroy_process_group()
    os._exit(0)  # as tests/test_ddp_reference.py: DDP's reducer may hang in its destructor


def test_powersgd_reaches_the_parameters_of_torchs_hook_under_ddp(tmp_path):
    """torch's ``powerSGD_hook`` (rank 1, warm start, error feedback, uncompressed for the
    first 2 steps) under DDP in two processes, each on the half of every global batch that
    elastic_dp gives its rank: the same parameters up to float order. The MLP's matrices sit
    in DDP's bucket in the order of elastic_dp's, last first; where DDP's rebuilt bucket
    orders them otherwise (the tiny GPT's positional table before its token table), the
    first factors are drawn in another order (docs/compression.md)."""
    spec, steps = PowerSGDSpec(rank=1, start=2), 12
    config = dataclasses.replace(MLP_TASK.defaults, steps=steps, micro_batch=None, compress=spec.describe())
    initial = initial_weights(MLP_TASK, config.seed)
    path = _save(initial, tmp_path / "initial.safetensors")
    ours, _, _ = train(MLP_TASK, config, 2, range(steps), initial)
    out = str(tmp_path / "ddp.safetensors")
    mp.start_processes(_ddp_rank, args=(str(tmp_path / "store"), path, out, spec, steps), nprocs=2,
                       start_method="spawn")
    theirs = load_file(out)
    assert max_abs_diff(ours, theirs) < MLP_TOL
    assert max_abs_diff(theirs, replay(MLP_TASK, dataclasses.replace(config, compress=None), path)) > COMPRESSED_APART


# -- the setting ---------------------------------------------------------------------------------
def test_the_compress_setting_is_parsed_and_bad_values_are_named():
    assert parse_compress("powersgd:rank=4") == PowerSGDSpec(rank=4, start=10, min_ratio=2.0)
    assert parse_compress("powersgd:rank=1:start=0:min-ratio=3.5") == PowerSGDSpec(rank=1, start=0, min_ratio=3.5)
    for text, says in (("int4", r"TrainConfig\.compress must be one of powersgd"), ("powersgd", "needs rank=R"),
                       ("powersgd:rank=0", "rank must be >= 1"), ("powersgd:rank=2:start=-1", "start must be >= 0"),
                       ("powersgd:rank=two", "rank must be a number"), ("powersgd:rank=2:depth=3", "takes rank=R")):
        with pytest.raises(ConfigError, match=says):
            TrainConfig(compress=text)
    TrainConfig(zero=2, compress="powersgd:rank=2")  # stages 1 and 2 reduce-scatter compressed
    for settings, says in (
            ({"zero": 3}, r"TrainConfig\.compress='int8' .* ZeRO stage 3 never holds.*or drop TrainConfig\.compress"),
            ({"zero": 2, "shard_scope": "host"}, r"TrainConfig\.shard_scope='host' cuts the state inside each host"),
            ({"zero": 1, "snapshot_every": 2}, r"use TrainConfig\.snapshot_every=1 with TrainConfig\.compress")):
        with pytest.raises(ConfigError, match=says):
            TrainConfig(compress="int8", **settings)
    with pytest.raises(ConfigError, match=r"TrainConfig\.compress_scope='hosts' compresses .* stage 2 reduce-scatters"):
        TrainConfig(zero=2, compress="int8", compress_scope="hosts")
    with pytest.raises(ConfigError, match=r"TrainConfig\.all_reduce='hierarchical' asks for the hosts' one"):
        TrainConfig(compress="powersgd:rank=2", all_reduce="hierarchical")


# -- a new generation: the factors agreed on, the errors' sum kept, a lost error said --------------
def _reductions(world: int) -> list:
    from elastic_dp.comm.compression import PowerSGD
    from elastic_dp.comm.reducer import make_buckets

    out = []
    for _ in range(world):
        params = [torch.nn.Parameter(torch.zeros(12, 10)), torch.nn.Parameter(torch.zeros(12))]
        reduction = PowerSGD(None, PowerSGDSpec(rank=2, start=1), seed=7)
        reduction.bind(make_buckets(params, 1 << 20, True))
        out.append(reduction)
    return out


def _steps(reductions: list, members: list[int], generation: int, steps: int) -> None:
    """``steps`` reductions of random gradients by ``reductions[m]`` for m in ``members``
    (ranks in that order), in a generation of their own."""
    from tests.ranks import run_ranks

    def rank_fn(group):
        reduction = reductions[members[group.rank]]
        reduction.group = group
        generator = torch.Generator().manual_seed(100 * generation + group.rank)
        reduction.follow()  # a new generation: the reduction agrees on its state for it
        for _ in range(steps):
            reduction.follow()
            reduction.launch(0, torch.randn(132, generator=generator)).wait()

    run_ranks(len(members), rank_fn, generation=generation)


def _error_sum(reductions: list, members: list[int]) -> torch.Tensor:
    return sum(reductions[m].errors[0] for m in members)


def test_a_joiner_takes_the_factors_and_a_lost_workers_error_is_taken_over_from_its_copy():
    """Workers 0-2 reduce as ranks 0-2, worker 3 joins as rank 1 (one host: each rank's error
    is copied to the next rank, cyclically). A joiner gets the factors and the step count and
    no error; a lost worker's error is taken over by the rank that held its copy, so the
    errors' sum (all the contract keeps) is the one before; two neighbours lost together
    lose the first's error with its copy, which the survivors count and say."""
    reductions = _reductions(4)
    _steps(reductions, [0, 1, 2], 0, 3)
    assert float(_error_sum(reductions, [0, 1, 2]).abs().max()) > 0
    _steps(reductions, [0, 3, 1, 2], 1, 0)
    for r in (1, 2, 3):
        assert reductions[r].iter == reductions[0].iter and torch.equal(reductions[r].qs[0], reductions[0].qs[0])
    assert 0 not in reductions[3].errors
    _steps(reductions, [0, 3, 1, 2], 1, 2)  # the four reduce together
    before = _error_sum(reductions, [0, 3, 1, 2])
    assert reductions[2].copy_of == reductions[1]._token  # rank 3 (worker 2) holds rank 2's (worker 1's)
    _steps(reductions, [0, 3, 2], 2, 0)  # worker 1 lost
    assert torch.allclose(_error_sum(reductions, [0, 3, 2]), before, atol=1e-6)
    assert [reductions[r].errors_lost for r in (0, 2, 3)] == [0, 0, 0]
    _steps(reductions, [0, 3, 2], 2, 1)
    # workers 3 and 2, ranks 1 and 2 now: worker 3's copy was on worker 2, which goes with it
    _steps(reductions, [0], 3, 0)
    assert reductions[0].errors_lost == 1


def test_a_worker_lost_in_the_first_generation_has_its_error_taken_over():
    reductions = _reductions(3)
    _steps(reductions, [0, 1, 2], 0, 3)
    before = _error_sum(reductions, [0, 1, 2])
    _steps(reductions, [0, 2], 1, 0)  # worker 1 lost: worker 2, its right neighbour, held its copy
    assert torch.allclose(_error_sum(reductions, [0, 2]), before, atol=1e-6)
    assert [reductions[r].errors_lost for r in (0, 2)] == [0, 0]
    for r in (0, 2):  # the new generation's first step does not commit: what it took over stays
        reductions[r].restore()
    assert torch.allclose(_error_sum(reductions, [0, 2]), before, atol=1e-6)


def test_an_expert_no_worker_chose_gets_no_update_under_compression_and_one_some_chose_gets_their_sum(tmp_path):
    """Issue 43's semantics with a compressor: the hand-written MoE (16 experts, top-1, AdamW
    with weight decay), where each step leaves about half of the experts unused, a different
    half on each worker. A parameter no worker gave a gradient gets no update (its error
    still follows the contract: M = E); one some workers used gets the approximation of
    their sum: at 1, 2 and 3 workers on the contract's replay, which leaves ``None``
    gradients alone, and far from a run that zero-fills them. Six steps, one bucket: the
    matrices of an expert left unused for a while warm-start from a Q that its tiny error
    (~1e-9) decided, so float order there turns into 1e-3 differences later (measured with
    0.0005 MiB buckets at 2 workers, docs/compression.md)."""
    from tests.tasks import MOE_TASK
    from tests.test_unused_params import _zero_filled

    config = dataclasses.replace(MOE_TASK.defaults, steps=6, compress="powersgd:rank=1:start=2")
    initial = initial_weights(MOE_TASK, config.seed)
    path = _save(initial, tmp_path / "initial.safetensors")
    contract = replay(MOE_TASK, config, path)
    zero_filled = replay(dataclasses.replace(MOE_TASK, loss=_zero_filled), config, path)
    for world in (1, 2, 3):
        weights, _, _ = train(MOE_TASK, config, world, range(6), initial)
        assert max_abs_diff(weights, contract) < MLP_TOL, world  # measured 1.2e-7 to 2.7e-7
        assert max_abs_diff(weights, zero_filled) > 1e-2, world


def test_a_re_formation_finds_an_error_that_left_with_its_copy():
    """``lost_errors`` over the survivors' holdings: the last generation's workers A, B, C, D,
    each holding the copy of its left neighbour's error (B holds A's, C holds B's, ...)."""
    from elastic_dp.comm.feedback import lost_errors

    members = [1, 2, 3, 4]

    def held(token, copy_of):
        return {"token": token, "copy_of": copy_of, "members": members, "errors": True}

    everyone = {1: held(1, 4), 2: held(2, 1), 3: held(3, 2), 4: held(4, 3)}
    assert lost_errors([everyone[t] for t in (1, 3, 4)]) == 0  # B lost: C holds its copy
    assert lost_errors([everyone[t] for t in (1, 4)]) == 1  # B and C lost: B's copy went with C
    assert lost_errors([everyone[t] for t in (1, 3)]) == 0  # B and D: their copies on C and A
    assert lost_errors([dict(everyone[1], errors=False)]) == 0  # no error yet: nothing to lose
    assert lost_errors([{}]) == 0  # an uncompressed run


@pytest.mark.parametrize("task", [TINY_GPT_TASK, MLP_TASK], ids=["gpt", "mlp"])
def test_int8_follows_the_replay_that_simulates_each_member(tmp_path, task):
    """``--compress int8``: each bucket as blockwise-scaled int8, each member's error fed back.
    Not linear, so its contract simulates the members (tests.reference.replay_members): at 1,
    2 and 3 workers the same up to float order (measured 0: the integers snap it), and off
    the uncompressed run by far more (the GPT 1.7e-2, the MLP 7.3e-4 to 1.2e-3, 8 steps)."""
    from tests.reference import replay_members

    config = dataclasses.replace(task.defaults, steps=8, micro_batch=None, compress="int8")
    initial = initial_weights(task, config.seed)
    path = _save(initial, tmp_path / "initial.safetensors")
    plain = replay(task, dataclasses.replace(config, compress=None), path)
    for world in (1, 2, 3):
        contract = replay_members(task, config, path, world=world)
        weights, _, _ = train(task, config, world, range(8), initial)
        assert max_abs_diff(weights, contract) < MLP_TOL, world
        assert max_abs_diff(weights, plain) > 5e-4, world


INT8_ZERO_TOL = {"mlp": MLP_TOL, "gpt": 2e-4}
"""int8 at ZeRO-2 against its replay, 8 steps: the MLP's SGD measured 0 to 3e-8; on the tiny
GPT's AdamW ZeRO's own float order (1.0e-6 from the plain replay uncompressed at 1 worker)
flips a rounding edge of the integers now and then: measured 1.8e-5 to 5.3e-5 (one run each,
2026-12-06), 4x margin, and still 50x under the distance to stage 0's contract (9.4e-3 to 1.6e-2)."""


@pytest.mark.parametrize("task", [TINY_GPT_TASK, MLP_TASK], ids=["gpt", "mlp"])
def test_int8_at_zero_2_reduce_scatters_as_its_replay_simulates_each_member(tmp_path, task):
    """``--compress int8`` at ZeRO-2: each rank's chunk of each bucket is the sum of the
    members' int8 chunks, kept in fp32 (half the all-reduce's bytes, one quantization): the
    reduce-scatter of ``replay_members`` (``quantized_scatter_sum``) at 1, 2 and 3 workers,
    not stage 0's all-reduce, and far from the uncompressed run."""
    from tests.reference import replay_members

    config = dataclasses.replace(task.defaults, steps=8, micro_batch=None, compress="int8", zero=2)
    initial = initial_weights(task, config.seed)
    path = _save(initial, tmp_path / "initial.safetensors")
    plain = replay(task, dataclasses.replace(config, compress=None, zero=0), path)
    tol = INT8_ZERO_TOL["gpt" if task is TINY_GPT_TASK else "mlp"]
    for world in (1, 2, 3):
        weights, _, _ = train(task, config, world, range(8), initial)
        assert max_abs_diff(weights, replay_members(task, config, path, world=world)) < tol, world
        assert max_abs_diff(weights, plain) > 5e-4, world
        if world > 1:  # the reduce-scatter is not the all-reduce's two quantizations
            stage0 = replay_members(task, dataclasses.replace(config, zero=0), path, world=world)
            assert max_abs_diff(weights, stage0) > 10 * tol, world


@pytest.mark.parametrize("hosts", ["AABB", "AAB", "ABC", "AA"])
def test_int8_on_the_hop_between_hosts_follows_its_contract_and_leaves_a_host_exact(tmp_path, hosts):
    """``--compress int8 --compress-scope hosts``: each bucket summed inside each host in fp32,
    each piece all-reduced across the hosts as int8, gathered inside the host: the replay of
    that contract (tests.reference.replay_hosts) exactly (measured 0), on hosts of equal and
    unequal sizes and one rank a host; far from the uncompressed run across hosts (1.3e-2 to
    1.5e-2 on the GPT) and on it where every rank shares one host (2.4e-6: nothing quantized)."""
    from tests.reference import replay_hosts

    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=6, micro_batch=None, compress="int8", compress_scope="hosts")
    initial = initial_weights(task, config.seed)
    path = _save(initial, tmp_path / "initial.safetensors")
    plain = replay(task, dataclasses.replace(config, compress=None, compress_scope="all"), path)
    weights, _, _ = train(task, config, len(hosts), range(6), initial, hosts=tuple(hosts))
    assert max_abs_diff(weights, replay_hosts(task, config, path, hosts=tuple(hosts))) < MLP_TOL
    if len(set(hosts)) > 1:
        assert max_abs_diff(weights, plain) > 5e-3
    else:
        assert max_abs_diff(weights, plain) < GPT_TOL


def test_the_hop_between_hosts_is_compressed_only_where_that_is_defined():
    with pytest.raises(ConfigError, match=r"PowerSGD's matrices span the pieces"):
        TrainConfig(compress="powersgd:rank=2", compress_scope="hosts")
    with pytest.raises(ConfigError, match=r"all_reduce='flat' asks for one ring"):
        TrainConfig(compress="int8", compress_scope="hosts", all_reduce="flat")
    assert TrainConfig(compress="int8", compress_scope="hosts", all_reduce="hierarchical").buckets.compress_scope == \
        "hosts"
