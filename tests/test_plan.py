"""``elastic-dp plan`` against the published ZeRO arithmetic (Rajbhandari et al., 2020:
a 7.5B-parameter model with mixed-precision Adam needs 120 GB per device without
sharding, 31.4 GB with optimizer-state sharding and 16.6 GB with gradients sharded too,
at 64 devices)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic_dp import cli
from elastic_dp.errors import ConfigError
from elastic_dp.observe.capacity import MemoryPlan, parse_size


@pytest.mark.parametrize("workers", [1, 8, 64])
def test_stage_0_is_16_bytes_per_parameter_at_any_worker_count(workers):
    plan = MemoryPlan(params=7.5e9, workers=workers, zero=0)
    assert plan.bytes_per_param() == {"parameters": 2, "gradients": 2, "optimizer_state": 12, "total": 16}
    assert plan.per_worker_bytes()["total"] == 120e9


@pytest.mark.parametrize("zero, published_gb", [(0, 120.0), (1, 31.4), (2, 16.6)])
def test_the_zero_paper_figures_for_7_5b_parameters_on_64_devices(zero, published_gb):
    total = MemoryPlan(params=7.5e9, workers=64, zero=zero).per_worker_bytes()["total"]
    assert round(total / 1e9, 1) == published_gb


def test_fp32_and_sgd_variants():
    assert MemoryPlan(1e6, 4, 0, precision="fp32").bytes_per_param()["total"] == 16  # 4 + 4 + 8
    assert MemoryPlan(1e6, 4, 2, precision="fp32").bytes_per_param() == {
        "parameters": 4, "gradients": 1, "optimizer_state": 2, "total": 7}
    assert MemoryPlan(1e6, 4, 1, optimizer="sgd").bytes_per_param()["optimizer_state"] == 1  # fp32 master / 4


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_workers_needed_is_the_fewest_that_fit(zero):
    gpu = 80e9
    plan = MemoryPlan(params=7.5e9, workers=64, zero=zero)
    need = plan.workers_needed(gpu)
    if zero == 0:
        assert need is None  # 120 GB never fits 80 GB without sharding
        return
    assert plan.per_worker_bytes(need)["total"] <= gpu
    assert need == 1 or plan.per_worker_bytes(need - 1)["total"] > gpu
    assert MemoryPlan(params=1e9, workers=1, zero=0).workers_needed(gpu) == 1


def test_communication_per_step():
    n, psi = 4, 1e9
    assert MemoryPlan(psi, n, 0).comm_bytes_per_step() == pytest.approx(2 * 3 / 4 * 2 * psi)
    assert MemoryPlan(psi, n, 1).comm_bytes_per_step() == pytest.approx(3 / 4 * 4 * psi)
    assert MemoryPlan(psi, n, 2).comm_bytes_per_step() == pytest.approx(3 / 4 * 4 * psi)
    assert MemoryPlan(psi, 1, 2).comm_bytes_per_step() == 0
    # stage 3: the parameters gathered in the forward and again in the backward, the gradients scattered
    assert MemoryPlan(psi, n, 3).comm_bytes_per_step() == pytest.approx(3 / 4 * (2 * 2 + 2) * psi)
    assert MemoryPlan(psi, n, 3, reshard=False).comm_bytes_per_step() == pytest.approx(3 / 4 * 4 * psi)


def test_stage_3_needs_81_devices_for_405b_and_says_what_the_gathered_units_add():
    """16 bytes of training state a parameter, all sharded: 6.48 TB over 80 GB devices is
    81. The gathered units (a 3.2e9-parameter block computing and the next prefetched, in
    bf16, and the block's bf16 gradient) take 19.2 GB of every device: 6.48e12 / 60.8e9
    needs 107."""
    plan = MemoryPlan(params=405e9, workers=128, zero=3)
    assert plan.bytes_per_param(81)["total"] == pytest.approx(16 / 81)
    assert plan.workers_needed(80e9) == 81
    assert MemoryPlan(params=405e9, workers=128, zero=2).workers_needed(80e9) is None  # stage 2 never fits
    units = MemoryPlan(params=405e9, workers=128, zero=3, unit_params=3.2e9)
    assert units.gathered_bytes() == pytest.approx((2 * 2 + 2) * 3.2e9)
    report = units.report(80e9)
    assert report["workers_needed"] == 81 and report["workers_needed_with_gathered_units"] == 107
    kept = MemoryPlan(params=405e9, workers=128, zero=3, unit_params=3.2e9, reshard=False)
    assert kept.gathered_bytes() == pytest.approx(2 * 405e9 + 2 * 3.2e9)  # every parameter at the forward's end


def test_snapshot_memory_only_where_chunks_are_snapshotted():
    """Two own and two neighbour's snapshots of a chunk of fp32 master and Adam moments,
    12Ψ/N each; none without sharding or without a neighbour (the measured figure:
    tests/test_zero_snapshots.py)."""
    one = 12 * 7.5e9 / 64
    assert MemoryPlan(7.5e9, 64, 1).snapshot_bytes() == {
        "host": 4 * one, "host_neighbour_on_same_host": 2 * one, "device_while_sent": 2 * one}
    assert MemoryPlan(7.5e9, 64, 2, optimizer="sgd").snapshot_bytes()["host"] == 4 * 4 * 7.5e9 / 64
    assert set(MemoryPlan(7.5e9, 64, 0).snapshot_bytes().values()) == {0.0}
    assert set(MemoryPlan(7.5e9, 1, 2).snapshot_bytes().values()) == {0.0}


@pytest.mark.parametrize("text, value", [("7.5e9", 7.5e9), ("125M", 125e6), ("80GB", 80e9), ("80GiB", 80 * 2**30),
                                         ("1.5b", 1.5e9)])
def test_sizes(text, value):
    assert parse_size(text, "--x") == value


def test_cli_text_and_json(capsys):
    cmd = [sys.executable, "-m", "elastic_dp.cli", "plan", "--params", "7.5e9", "--workers", "64", "--zero", "1",
           "--gpu-memory", "80GB"]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout  # the real command
    assert "ZeRO stage 1" in text and "needs at least 2 device(s)" in text
    assert cli.main(["plan", *cmd[4:], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["per_worker_bytes"]["total"] == pytest.approx(31.40625e9)
    assert report["workers_needed"] == 2 and report["fits"] is True


@pytest.mark.parametrize("args, message", [
    (["--params", "0", "--workers", "4"], "--params must be positive"),
    (["--params=-3", "--workers", "4"], "--params must be positive"),
    (["--params", "lots", "--workers", "4"], "--params expects a number"),
    (["--params", "1e9", "--workers", "0"], "--workers must be a positive integer"),
    (["--params", "1e9", "--workers", "4", "--zero", "4"], "--zero must be stage 0, 1, 2 or 3"),
    (["--params", "1e9", "--workers", "4", "--zero", "2", "--unit-params", "1e8"], "ZeRO stage 3's: add --zero 3"),
    (["--params", "1e9", "--workers", "4", "--zero", "3", "--unit-params", "2e9"], "at most --params"),
    (["--params", "1e9", "--workers", "4", "--gpu-memory=-80GB"], "--gpu-memory must be positive"),
    (["--params", "1e9", "--workers", "4", "--spares=-1"], "--spares must be a non-negative integer"),
])
def test_bad_plan_input_is_named(args, message, capsys):
    assert cli.main(["plan", *args]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ConfigError):
        MemoryPlan(params=0, workers=1, zero=0)


def test_the_bytes_over_each_hosts_link_follow_the_closed_forms_of_docs_hosts():
    gradient = 4 * 1e6  # fp32
    two = MemoryPlan(params=1e6, workers=4, zero=0, precision="fp32", hosts=2).link_bytes_per_step()
    assert two == {"flat": pytest.approx(1.5 * gradient), "hierarchical": pytest.approx(1.0 * gradient)}
    eight = MemoryPlan(params=1e6, workers=64, zero=0, precision="fp32", hosts=8).link_bytes_per_step()
    assert eight == {"flat": pytest.approx(2 * 63 / 64 * gradient), "hierarchical": pytest.approx(2 * 7 / 8 * gradient)}
    # stage 2 moves gradients and parameters: gloo's all-to-alls send W(H-1)/H of them per host, NCCL's rings (N-1)/N
    zero2 = MemoryPlan(params=1e6, workers=4, zero=2, precision="fp32", hosts=2).link_bytes_per_step()
    # --shard-scope host: only each chunk's gradient crosses, all-reduced among its H replicas: 2(H-1)/H of it
    assert zero2 == {"gloo": pytest.approx(2 * 0.5 * 2 * gradient), "nccl": pytest.approx(0.75 * 2 * gradient),
                     "host": pytest.approx(1.0 * gradient)}
    zero3 = MemoryPlan(params=1e6, workers=4, zero=3, precision="fp32", hosts=2).link_bytes_per_step()
    assert zero3["gloo"] == pytest.approx(2 * 0.5 * 3 * gradient) and zero3["host"] == pytest.approx(gradient)
    eight3 = MemoryPlan(params=1e6, workers=64, zero=3, precision="fp32", hosts=8).link_bytes_per_step()
    assert eight3["host"] == pytest.approx(2 * 7 / 8 * gradient)
    assert MemoryPlan(params=1e6, workers=4, zero=0, hosts=1).link_bytes_per_step() == {"flat": 0.0, "hierarchical": 0.0}
    assert MemoryPlan(params=1e6, workers=4, zero=0).link_bytes_per_step() == {}


def test_shard_scope_host_cuts_the_state_over_a_hosts_workers_and_keeps_no_peer_snapshot():
    everywhere = MemoryPlan(params=1e6, workers=64, zero=3, hosts=8)
    hsdp = MemoryPlan(params=1e6, workers=64, zero=3, hosts=8, shard_scope="host")
    assert hsdp.bytes_per_param() == everywhere.bytes_per_param(workers=8)  # 1/W of it, not 1/N
    assert hsdp.snapshot_bytes()["host"] == 0 and everywhere.snapshot_bytes()["host"] > 0
    p, g = 2, 2  # bf16: inside the host the stage's collectives over 8 workers, across it the chunk's all-reduce
    assert hsdp.comm_bytes_per_step() == pytest.approx((7 / 8 * (2 * p + g) + 2 * 7 / 8 * g / 8) * 1e6)
    for kw, message in (({"zero": 0}, "inside each host: give"), ({"hosts": None}, "inside each host: give"),
                        ({"shard_scope": "rack"}, "must be all or host")):
        with pytest.raises(ConfigError, match=message):
            MemoryPlan(**{"params": 1e6, "workers": 64, "zero": 3, "hosts": 8, "shard_scope": "host", **kw})


def test_plan_takes_hosts_and_workers_per_host_and_refuses_what_does_not_add_up(capsys):
    from elastic_dp.cli import main

    assert main(["plan", "--params", "1M", "--hosts", "2", "--workers-per-host", "2", "--precision", "fp32"]) == 0
    assert "over each host's link per step (2 hosts of 2 workers): flat 6 MB, hierarchical 4 MB" in capsys.readouterr().out
    for argv, message in ((["--workers-per-host", "2"], "--workers-per-host needs --hosts"),
                          (["--hosts", "2", "--workers-per-host", "2", "--workers", "5"], "--workers 5 is not --hosts 2"),
                          (["--hosts", "3", "--workers", "4"], "--hosts must be a positive divisor of the 4 workers"),
                          ([], "give --workers, or --hosts and --workers-per-host")):
        assert main(["plan", "--params", "1M", *argv]) != 0
        assert message in capsys.readouterr().err


def test_spares_are_devices_of_their_own_that_must_hold_a_workers_state_once_promoted(capsys):
    assert cli.main(["plan", "--params", "7.5e9", "--workers", "64", "--zero", "1", "--spares", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["spares"] == {"workers": 2, "devices": 66, "bytes_each_once_promoted": pytest.approx(31.40625e9)}
    assert "spares" not in MemoryPlan(params=7.5e9, workers=64, zero=1).report()


def test_plan_gives_the_bytes_of_a_compressed_step_from_the_jobs_shapes(capsys):
    """``--job jobs.gpt --compress powersgd:rank=2``: each matrix of n x m (a tensor of two or
    more dimensions as (shape[0], -1)) whose n·m is more than twice (n + m)·r sends (n + m)·r
    elements, every other tensor its own; a ring all-reduce of those at 2 workers is 1x them,
    and at 2 hosts of 2 workers each link carries 2(N-1)/N = 1.5x; the copy of each worker's
    error is the whole model's gradient here (one 25 MiB bucket)."""
    import json

    from jobs.gpt import TASK

    elements = 0
    for p in TASK.model().parameters():
        n = p.shape[0]
        m, r = p.numel() // n, min(p.shape[0], p.numel() // n, 2)
        elements += (n + m) * r if p.dim() >= 2 and (n + m) * r * 2 < n * m else p.numel()
    total = sum(p.numel() for p in TASK.model().parameters())
    assert cli.main(["plan", "--job", "jobs.gpt", "--workers", "2", "--compress", "powersgd:rank=2", "--precision",
                     "fp32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["comm_bytes_per_step"] == 4 * elements < 0.05 * 4 * total
    assert report["compress"]["copy_bytes_per_step"] == 4 * total
    assert report["compress"]["uncompressed_bytes_per_step"] == 4 * total  # 2(N-1)/N = 1 at N = 2
    assert cli.main(["plan", "--job", "jobs.gpt", "--hosts", "2", "--workers-per-host", "2", "--compress",
                     "powersgd:rank=2", "--precision", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["link_bytes_per_host_per_step"] == {"compressed": 1.5 * 4 * elements}
    for argv, says in ((["--params", "1M", "--workers", "2", "--compress", "powersgd:rank=2"], "give --job MODULE"),
                       (["--job", "jobs.gpt", "--workers", "2", "--zero", "3", "--compress", "powersgd:rank=2"],
                        "--zero 3 never holds"),
                       (["--workers", "2"], "give --params")):
        assert cli.main(["plan", *argv]) == 2
        assert says in capsys.readouterr().err


def test_plan_halves_stage_3_s_gathers_with_bf16_parameters_and_keeps_the_fp32_masters():
    """``--zero 3 --param-dtype bf16`` on fp32 parameters: the gathers send 2 bytes a
    parameter, the reduce-scatter 4 (fp32): (N-1)/N (2·2 + 4) against (N-1)/N (2·4 + 4);
    each chunk holds its bf16 parameters (2/N) beside the fp32 master (in the optimizer
    state's 4 + 8 a parameter, over N)."""
    plain = MemoryPlan(params=1e6, workers=4, zero=3, precision="fp32")
    bf16 = MemoryPlan(params=1e6, workers=4, zero=3, precision="fp32", param_dtype="bf16")
    assert plain.comm_bytes_per_step() == 0.75 * 12 * 1e6 and bf16.comm_bytes_per_step() == 0.75 * 8 * 1e6
    assert bf16.per_worker_bytes()["parameters"] == 2 / 4 * 1e6
    assert bf16.per_worker_bytes()["optimizer_state"] == (4 + 8) / 4 * 1e6
    with pytest.raises(ConfigError, match="param_dtype='bf16' gathers ZeRO stage 3's parameters"):
        MemoryPlan(params=1e6, workers=4, zero=2, param_dtype="bf16")


def test_plan_gives_the_links_bytes_of_int8_on_the_hop_between_hosts_alone(capsys):
    """``--compress int8 --compress-scope hosts`` on 2 hosts of 2: each link carries 2(H-1)/H
    of the int8 bytes (1 byte an element and an fp32 scale a block of 128), a quarter of the
    hierarchical all-reduce's fp32 figure and a little more."""
    import json

    from elastic_dp.comm.quantize import BLOCK
    from jobs.gpt import TASK

    total = sum(p.numel() for p in TASK.model().parameters())  # one bucket of 25 MiB
    argv = ["plan", "--job", "jobs.gpt", "--hosts", "2", "--workers-per-host", "2", "--precision", "fp32", "--json"]
    assert cli.main([*argv, "--compress", "int8", "--compress-scope", "hosts"]) == 0
    compressed = json.loads(capsys.readouterr().out)["link_bytes_per_host_per_step"]["compressed"]
    padded = -(-total // BLOCK) * BLOCK
    assert compressed == padded + padded // BLOCK * 4  # 2(H-1)/H = 1 at H = 2
    assert cli.main(argv) == 0
    hierarchical = json.loads(capsys.readouterr().out)["link_bytes_per_host_per_step"]["hierarchical"]
    assert 0.25 < compressed / hierarchical < 0.27
    assert cli.main(["plan", "--job", "jobs.gpt", "--hosts", "2", "--workers-per-host", "2", "--compress",
                     "powersgd:rank=2", "--compress-scope", "hosts"]) == 2
    assert "--compress-scope hosts compresses the hop between the hosts of ZeRO stage 0's hierarchical all-reduce " \
           "with int8" in capsys.readouterr().err


def test_plan_gives_the_bytes_and_the_errors_of_compression_at_zero_2(capsys):
    """``--zero 2 --compress int8`` at 4 fp32 workers: the int8 reduce-scatter sends (N-1)/N of
    the quantized bytes (half stage 0's all-reduce of them) and the parameters' all-gather
    (N-1)/N of their fp32 bytes; ``--compress powersgd`` all-reduces its factors as at stage 0,
    2(N-1)/N. Each worker holds its error and its copy of a neighbour's, and at ZeRO-2 both
    as of the step before too: 4x the gradient's bytes (2x at stage 0)."""
    import json

    from jobs.gpt import TASK

    total = sum(p.numel() for p in TASK.model().parameters())  # one bucket of 25 MiB
    argv = ["plan", "--job", "jobs.gpt", "--workers", "4", "--precision", "fp32", "--json"]
    reports = {}
    for zero, compress in ((0, "int8"), (2, "int8"), (0, "powersgd:rank=2"), (2, "powersgd:rank=2")):
        assert cli.main([*argv, "--zero", str(zero), "--compress", compress]) == 0
        reports[zero, compress] = json.loads(capsys.readouterr().out)
    gather = 0.75 * 4 * total
    int8_0, int8_2 = (reports[z, "int8"]["comm_bytes_per_step"] for z in (0, 2))
    assert int8_2 - gather == pytest.approx(int8_0 / 2)
    psgd_0, psgd_2 = (reports[z, "powersgd:rank=2"]["comm_bytes_per_step"] for z in (0, 2))
    assert psgd_2 - gather == pytest.approx(psgd_0)
    assert reports[0, "int8"]["compress"]["error_bytes_per_worker"] == 2 * 4 * total
    assert reports[2, "int8"]["compress"]["error_bytes_per_worker"] == 4 * 4 * total


def test_stage_3_gathers_the_root_and_the_last_unit_once_a_step(capsys):
    """The root unit (the parameters in no unit, and one two units share) and the last unit
    stay gathered from their forward to their backward (docs/zero.md), so of stage 3's two
    all-gathers a step they take one: (N-1)/N ((2P + G)Ψ - P·Ψ_once) a worker, and over each
    link W(H-1)/H of that per host on gloo's all-to-alls. ``--job`` counts Ψ_once from the
    job's units (jobs.gpt: its blocks; here counted by hand from the model)."""
    import torch

    from elastic_dp.state.units import gathered_once
    from jobs.gpt import TASK

    plan = MemoryPlan(params=1e6, workers=4, zero=3, precision="fp32", hosts=2, gathered_once=2e5)
    assert plan.comm_bytes_per_step() == pytest.approx(0.75 * (12 * 1e6 - 4 * 2e5), rel=1e-12)  # float order
    assert plan.link_bytes_per_step()["gloo"] == 2 * 0.5 * (12 * 1e6 - 4 * 2e5)
    assert MemoryPlan(params=1e6, workers=4, zero=3, precision="fp32", gathered_once=2e5,
                      reshard=False).comm_bytes_per_step() == 0.75 * 8 * 1e6  # every unit gathered once already
    with pytest.raises(ConfigError, match="gathered_once must be between 0 and --params"):
        MemoryPlan(params=1e6, workers=4, zero=3, gathered_once=2e6)

    shared = torch.nn.Linear(3, 3)
    units = [torch.nn.Sequential(torch.nn.Linear(2, 2), shared), torch.nn.Linear(4, 4),
             torch.nn.Sequential(torch.nn.Linear(5, 5), shared)]
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), *units)
    assert gathered_once(model, units) == 42 + 12 + 30  # the root's layer, the shared one, the last unit's own

    model = TASK.model()
    by_hand = sum(p.numel() for p in model.parameters()) - sum(p.numel() for b in model.blocks[:-1]
                                                               for p in b.parameters())
    argv = ["plan", "--job", "jobs.gpt", "--hosts", "2", "--workers-per-host", "2", "--precision", "fp32",
            "--zero", "3", "--json"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["gathered_once"] == by_hand
    assert cli.main([*argv, "--params", "834304"]) == 0  # another count: the job's units are not its
    assert json.loads(capsys.readouterr().out)["inputs"]["gathered_once"] == 0
