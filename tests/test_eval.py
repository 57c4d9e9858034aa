"""Evaluation (``--eval-every``): the eval set split over the members, each share's loss
summed sample by sample; the logged loss equals a plain loop's mean over the same samples
with the same parameters, whatever the worker count, under ZeRO-2 and after a worker
killed while evaluating (which re-runs the evaluation, not a step)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from elastic_dp import ClusterConfig, ConfigError, Trainer
from elastic_dp.data import split
from elastic_dp.worker.replica import Replica
from tests.ranks import run_ranks
from tests.records import read_lines
from tests.tasks import MLP_TASK, TINY_GPT_TASK, tiny_held_out

REL = 1e-6  # float32 losses of other micro-batch splits, summed in float64


def plain_eval(task, state: dict, samples: int | None = None) -> float:
    """One model, ``model.eval()``, no gradients: the mean loss over the first ``samples``
    of the eval set, one sample at a time."""
    model = task.model()
    model.load_state_dict(state)
    model.eval()
    dataset = task.eval_dataset()
    n = len(dataset) if samples is None else samples
    with torch.no_grad():
        return sum(float(task.loss(model, task.collate([dataset[i]]))) for i in range(n)) / n


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_eval_loss_split_over_ranks_is_the_plain_mean(world):
    config = dataclasses.replace(TINY_GPT_TASK.defaults, eval_every=1)
    torch.manual_seed(config.seed)
    state = {k: v.clone() for k, v in TINY_GPT_TASK.model().state_dict().items()}
    n = len(tiny_held_out())

    def rank_fn(group):
        replica = Replica(TINY_GPT_TASK, config, torch.device("cpu"), group)
        replica.model.load_state_dict(state)
        share = split(np.arange(n), group.world_size)[group.rank]
        return replica.evaluate(int(share[0]), int(share[-1]) + 1), replica.model.training

    results = run_ranks(world, rank_fn)
    assert all(training for _, training in results), "the model is back in training mode"
    total = sum(loss for (loss, _), _ in results)
    assert sum(samples for (_, samples), _ in results) == n
    assert total / n == pytest.approx(plain_eval(TINY_GPT_TASK, state), rel=REL)


def test_eval_settings_are_refused_where_they_cannot_apply():
    with pytest.raises(ConfigError, match=r"TrainConfig.eval_every evaluates the task's Task.eval_dataset, and this "
                                          r"task has none"):
        Trainer(MLP_TASK, train=dataclasses.replace(MLP_TASK.defaults, eval_every=2))
    with pytest.raises(ConfigError, match="TrainConfig.eval_batches sets how much"):
        dataclasses.replace(MLP_TASK.defaults, eval_batches=2)
    with pytest.raises(ConfigError, match=r"TrainConfig.eval_every evaluates between synchronous steps"):
        dataclasses.replace(MLP_TASK.defaults, eval_every=2, mode="async")
    with pytest.raises(ConfigError, match=r"kill:step=2:rank=0:phase=eval can never fire: no evaluation runs after "
                                          r"step 2: TrainConfig.eval_every=2"):
        Trainer(TINY_GPT_TASK, train=dataclasses.replace(TINY_GPT_TASK.defaults, eval_every=2),
                inject=["kill:step=2:rank=0:phase=eval"])


@pytest.mark.ray
def test_a_worker_killed_while_evaluating_under_zero_2_re_runs_the_evaluation(ray_cluster, tmp_path, caplog):
    """3 workers, ZeRO-2, evaluations after steps 2, 4 and 6 on 5 global batches of the eval
    set; rank 1 dies in the last: the group re-forms (no step re-run) and evaluates again.
    The last evaluation is the plain mean with the final parameters. The progress lines give
    each held-out loss and each step by the index metrics.jsonl gives it."""
    caplog.set_level("INFO", logger="elastic_dp.observe.metrics")
    config = dataclasses.replace(TINY_GPT_TASK.defaults, steps=6, zero=2, eval_every=2, eval_batches=5)
    summary = Trainer(TINY_GPT_TASK, train=config, cluster=ClusterConfig(workers=3, min_workers=1),
                      out_dir=str(tmp_path), progress=False, inject=["kill:step=5:rank=1:phase=eval"]).fit()
    lines = read_lines(tmp_path / "metrics.jsonl")
    evals = [m for m in lines if "eval_loss" in m]
    assert [(m["step"], m["eval_samples"]) for m in evals] == [(1, 60), (3, 60), (5, 60)]
    assert [m["step"] for m in lines if "eval_loss" not in m] == list(range(6))  # no step re-run
    change = next(e for e in read_lines(tmp_path / "events.jsonl") if e["kind"] == "membership_changed")
    assert change["lost_ranks"] == [1] and change["steps_rerun"] == 0
    expected = plain_eval(TINY_GPT_TASK, load_file(tmp_path / "final.safetensors"), 60)
    assert evals[-1]["eval_loss"] == pytest.approx(expected, rel=REL)
    assert summary.eval_loss == evals[-1]["eval_loss"]
    assert evals[0]["eval_loss"] > evals[-1]["eval_loss"]
    said = [r.getMessage() for r in caplog.records if r.name == "elastic_dp.observe.metrics"]
    assert [m for m in said if m.startswith("held-out loss")] == [
        f"held-out loss after step {m['step']}: {m['eval_loss']:.4f} over 60 samples" for m in evals]
    last = lines[[i for i, m in enumerate(lines) if "eval_loss" not in m][-1]]
    assert any(m.startswith(f"gen {last['generation']} step 5 (6/6 done): loss {last['loss']:.4f}") for m in said)
