"""Config validation names the setting to change; the learning-rate rule."""

from __future__ import annotations

import pytest

from elastic_dp import CheckpointConfig, ClusterConfig, ConfigError, TrainConfig


@pytest.mark.parametrize("field, value, flag", [
    ("steps", -1, "--steps"), ("micro_batch", 0, "--micro-batch"), ("warmup_steps", -2, "--warmup-steps"),
    ("lr_reference_batch", 0, "--lr-reference-batch"), ("clip_grad_norm", 0.0, "--clip-grad-norm"),
    ("precision", "fp8", "--precision"), ("bucket_mb", 0, "--bucket-mb"),
])
def test_train_config_errors_name_the_flag(field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        TrainConfig(**{field: value})


def test_cluster_and_checkpoint_config_errors():
    with pytest.raises(ConfigError, match="--workers"):
        ClusterConfig(workers=0)
    with pytest.raises(ConfigError, match="--device"):
        ClusterConfig(device="tpu")
    with pytest.raises(ConfigError, match="--checkpoint-every"):
        CheckpointConfig(dir="x", every=-1)


def test_lr_factor_warmup_and_linear_scaling():
    config = TrainConfig(global_batch=64, warmup_steps=4, lr_reference_batch=32)
    assert [config.lr_factor(s) for s in range(6)] == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    assert TrainConfig().lr_factor(0) == 1.0


@pytest.mark.parametrize("spec", ["kill:step=2", "kill:step=x:rank=1", "explode:step=1:rank=0",
                                  "kill:step=1:rank=0:phase=lunch", "join:step=2:rank=1", "hang:rank=1"])
def test_bad_fault_specs_name_the_flag(spec):
    from elastic_dp import Fault

    with pytest.raises(ConfigError, match="--inject"):
        Fault.parse(spec)


def test_fault_specs_and_worker_ranges_parse():
    from elastic_dp import Fault
    from elastic_dp.cli import _worker_range

    assert Fault.parse("kill:step=3:rank=1:phase=allreduce") == Fault("kill", 3, 1, "allreduce")
    assert Fault.parse("join:step=4") == Fault("join", 4)
    assert _worker_range("2:5") == (2, 5) and _worker_range("3") == (3, 3)
    with pytest.raises(ConfigError, match="MIN:MAX"):
        ClusterConfig(workers=2, min_workers=3)
