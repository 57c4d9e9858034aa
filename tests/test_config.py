"""Config validation names the setting to change; the learning-rate rule."""

from __future__ import annotations

import pytest

from elastic_dp import CheckpointConfig, ClusterConfig, ConfigError, TrainConfig
from elastic_dp.faults import FaultPlan, parse_faults


@pytest.mark.parametrize("field, value", [
    ("steps", -1), ("micro_batch", 0), ("warmup_steps", -2), ("lr_reference_batch", 0), ("clip_grad_norm", 0.0),
    ("precision", "fp8"), ("bucket_mb", 0), ("first_bucket_mb", -1.0),
])
def test_train_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"\(TrainConfig\.{field}\)"):  # the API's name (test_errors: the CLI's)
        TrainConfig(**{field: value})


def test_cluster_and_checkpoint_config_errors():
    with pytest.raises(ConfigError, match=r"ClusterConfig\.workers"):
        ClusterConfig(workers=0)
    with pytest.raises(ConfigError, match=r"ClusterConfig\.device"):
        ClusterConfig(device="tpu")
    with pytest.raises(ConfigError, match=r"CheckpointConfig\.every"):
        CheckpointConfig(dir="x", every=-1)


@pytest.mark.parametrize("gpus", [0, -0.5, 1.5])
def test_a_worker_holds_at_most_one_gpu(gpus):
    with pytest.raises(ConfigError, match=r"ClusterConfig\.gpus_per_worker"):
        ClusterConfig(gpus_per_worker=gpus)


def test_workers_sharing_a_gpu_talk_through_gloo():
    assert ClusterConfig().backend_for("cuda") == "nccl"
    assert ClusterConfig(gpus_per_worker=0.5).backend_for("cuda") == "gloo"
    assert ClusterConfig().backend_for("cpu") == "gloo"
    assert ClusterConfig(backend="gloo").backend_for("cuda") == "gloo"
    with pytest.raises(ConfigError, match=r"NCCL refuses two ranks on one GPU.*ClusterConfig\.backend='gloo'"):
        ClusterConfig(gpus_per_worker=0.25, backend="nccl")
    with pytest.raises(ConfigError, match=r"ClusterConfig\.backend='nccl' needs GPUs.*ClusterConfig\.device='cuda'"):
        ClusterConfig(backend="nccl").backend_for("cpu")
    with pytest.raises(ConfigError, match=r"ClusterConfig\.backend"):
        ClusterConfig(backend="mpi")


def test_the_first_bucket_closes_early_on_a_gpu_not_on_a_cpu():
    mib = 2**20
    assert TrainConfig().buckets.first_bucket_bytes("cpu") == 25 * mib  # the whole bucket: one all-reduce
    assert TrainConfig(zero=2).buckets.first_bucket_bytes("cpu") == 25 * mib
    assert TrainConfig().buckets.first_bucket_bytes("cuda") == mib
    assert TrainConfig(zero=1).buckets.first_bucket_bytes("cuda") == mib
    assert TrainConfig(first_bucket_mb=4.0).buckets.first_bucket_bytes("cpu") == 4 * mib  # set: everywhere
    assert TrainConfig(first_bucket_mb=4.0, zero=2).buckets.first_bucket_bytes("cuda") == 4 * mib
    assert TrainConfig(bucket_mb=0.5).buckets.first_bucket_bytes("cuda") == mib // 2  # never past a bucket


def test_lr_factor_warmup_and_linear_scaling():
    config = TrainConfig(global_batch=64, warmup_steps=4, lr_reference_batch=32)
    assert [config.lr_factor(s) for s in range(6)] == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    assert TrainConfig().lr_factor(0) == 1.0


@pytest.mark.parametrize("spec", ["kill:step=2", "kill:step=x:rank=1", "explode:step=1:rank=0",
                                  "kill:step=1:rank=0:phase=lunch", "join:step=2:rank=1", "hang:rank=1"])
def test_bad_fault_specs_name_the_flag(spec):
    from elastic_dp import Fault

    with pytest.raises(ConfigError, match=r"Trainer's\ inject"):
        Fault.parse(spec)


def test_fault_specs_and_worker_ranges_parse():
    from elastic_dp import Fault
    from elastic_dp.cli import _worker_range

    assert Fault.parse("kill:step=3:rank=1:phase=allreduce") == Fault("kill", 3, 1, "allreduce")
    assert Fault.parse("join:step=4") == Fault("join", 4)
    assert _worker_range("2:5") == (2, 5) and _worker_range("3") == (3, 3)
    with pytest.raises(ConfigError, match=r"ClusterConfig\(min_workers=MIN, workers=MAX\) needs 1 <= MIN <= MAX"):
        ClusterConfig(workers=2, min_workers=3)


@pytest.mark.parametrize("specs, match", [
    (["kill:step=2:rank=3"], r"kill:step=2:rank=3:phase=forward can never fire: the run has at most 3 workers, "
                             r"ranks 0\.\.2 \(ClusterConfig\.workers\)"),
    (["hang:step=6:rank=0"], r"can never fire: the run trains steps 0\.\.5 \(TrainConfig\.steps=6\)"),
    (["join:step=9"], r"join:step=9 can never fire: .*TrainConfig\.steps=6"),
    (["kill:step=1:rank=0:phase=checkpoint"], r"without CheckpointConfig\.dir"),
    (["kill:step=0:rank=0:phase=reform"], r"re-forms after another fault in step 0: add a kill or hang at step=0"),
    (["kill:step=1:rank=0:phase=snapshot"], r"needs TrainConfig\.zero=1, 2 or 3"),
    (["kill:step=1:rank=0:phase=gather_forward"], r"phase=gather_forward fires as a unit's parameters are all-gathered, "
                                                  r"which only TrainConfig\.zero=3 does"),
    (["join:step=1", "join:step=2"], r"2 joins, but ClusterConfig\.workers=2:3 leaves room for 1.*raise MAX or lower MIN"),
])
def test_faults_that_can_never_fire_are_refused_naming_the_setting(specs, match):
    from elastic_dp.faults import parse_faults

    with pytest.raises(ConfigError, match=match):
        parse_faults(specs, TrainConfig(steps=6), ClusterConfig(workers=3, min_workers=2), CheckpointConfig())


def test_faults_that_can_fire_are_accepted():
    from elastic_dp.faults import parse_faults

    specs = ["kill:step=2:rank=1", "kill:step=2:rank=0:phase=reform", "kill:step=3:rank=0:phase=checkpoint",
             "hang:step=5:rank=2:phase=allreduce", "join:step=1"]
    faults = parse_faults(specs, TrainConfig(steps=6), ClusterConfig(workers=3, min_workers=2),
                          CheckpointConfig(dir="ckpt", every=2))
    assert [str(f) for f in faults] == ["kill:step=2:rank=1:phase=forward", *specs[1:]]
    with pytest.raises(ConfigError, match=r"no checkpoint is saved after step 2: CheckpointConfig\.every=2"):
        parse_faults(["kill:step=2:rank=0:phase=checkpoint"], TrainConfig(steps=6),
                     ClusterConfig(workers=3), CheckpointConfig(dir="ckpt", every=2))
    with pytest.raises(ConfigError, match=r"phase=upload fires in a background save.*CheckpointConfig\(asynchronous=False\)"):
        parse_faults(["kill:step=3:rank=1:phase=upload"], TrainConfig(steps=6),
                     ClusterConfig(workers=3), CheckpointConfig(dir="ckpt", every=2, asynchronous=False))
    assert parse_faults(["kill:step=3:rank=1:phase=upload"], TrainConfig(steps=6), ClusterConfig(workers=3),
                        CheckpointConfig(storage="s3ish", every=2))[0].phase == "upload"


def test_a_fault_that_did_not_fire_is_handed_out_again_or_reported_with_the_reason():
    from elastic_dp.faults import STEP_PHASES, Fault, FaultPlan

    optimizer = Fault("kill", 2, 0, "optimizer")
    plan = FaultPlan([Fault("kill", 1, 2), optimizer, Fault("kill", 3, 0, "checkpoint"),
                      Fault("kill", 4, 1, "reform"), Fault("kill", 9, 0)])
    assert plan.take_step(1, 2, STEP_PHASES) == {}  # step 1 runs on 2 ranks: no rank 2
    assert plan.take_step(2, 2, STEP_PHASES) == {0: optimizer}
    plan.put_back([optimizer])  # rank 0 came back: the step failed before its optimizer phase
    assert plan.take_step(2, 3, STEP_PHASES) == {0: optimizer}  # the re-run gets it again
    assert plan.take_reform(4, 1) == {}
    assert dict((str(f), why) for f, why in plan.unfired()) == {
        "kill:step=1:rank=2:phase=forward": "step 1 had 2 workers: there was no rank 2",
        "kill:step=3:rank=0:phase=checkpoint": "no checkpoint was saved after step 3 in this run",
        "kill:step=4:rank=1:phase=reform": "the generation re-formed after it had 1 workers: there was no rank 1",
        "kill:step=9:rank=0:phase=forward": "step 9 was never run in this run"}


def test_a_straggler_spec_parses_and_applies_to_its_steps():
    from elastic_dp.faults import Fault

    f = Fault.parse("slow:rank=1:factor=3:from=2:to=5")
    assert (f.kind, f.rank, f.factor, f.step, f.until) == ("slow", 1, 3.0, 2, 5)
    assert [s for s in range(7) if f.slows(s)] == [2, 3, 4]
    assert Fault.parse(str(f)) == f
    assert Fault.parse("slow:rank=0:factor=2.5").slows(10**6)
    plan = FaultPlan(parse_faults(["slow:rank=1:factor=3", "kill:step=2:rank=0"], TrainConfig(steps=4),
                                  ClusterConfig(workers=2), CheckpointConfig()))
    assert set(plan.slow) == {1} and [str(f) for f, _ in plan.unfired()] == ["kill:step=2:rank=0:phase=forward"]


@pytest.mark.parametrize("spec", ["slow:rank=1", "slow:rank=1:factor=0.5", "slow:rank=1:factor=2:from=3:to=3",
                                  "slow:rank=-1:factor=2", "slow:step=1:rank=0:factor=2",
                                  "slow:rank=0:factor=2:phase=forward"])
def test_bad_straggler_specs_name_the_form(spec):
    with pytest.raises(ConfigError, match="slow:rank=R:factor=F"):
        parse_faults([spec], TrainConfig(steps=4), ClusterConfig(workers=2), CheckpointConfig())


def test_stragglers_that_cannot_slow_anything_are_refused():
    with pytest.raises(ConfigError, match="ranks 0..1"):
        parse_faults(["slow:rank=2:factor=2"], TrainConfig(steps=4), ClusterConfig(workers=2), CheckpointConfig())
    with pytest.raises(ConfigError, match=r"TrainConfig\.steps=4"):
        parse_faults(["slow:rank=0:factor=2:from=4"], TrainConfig(steps=4), ClusterConfig(workers=2),
                     CheckpointConfig())
    with pytest.raises(ConfigError, match="one spec per rank"):
        parse_faults(["slow:rank=0:factor=2", "slow:rank=0:factor=3"], TrainConfig(steps=4),
                     ClusterConfig(workers=2), CheckpointConfig())


def test_the_all_reduce_is_stage_0s_and_refused_at_the_sharded_stages_naming_it():
    assert TrainConfig(all_reduce="hierarchical").buckets.all_reduce == "hierarchical"
    with pytest.raises(ConfigError, match=r"TrainConfig\.all_reduce='hierarchical' chooses ZeRO stage 0's all-reduce; "
                                          r"stage 2 reduce-scatters"):
        TrainConfig(zero=2, all_reduce="hierarchical")
