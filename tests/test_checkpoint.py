"""Checkpoint files: atomic, checksummed, optimizer state keyed by parameter name."""

from __future__ import annotations

import json

import pytest
import torch

from elastic_dp import CheckpointError
from elastic_dp.checkpoint import CheckpointStore, TrainingState, load_optimizer_state, optimizer_state
from tests.tasks import mlp, sgd_two_groups


def _trained():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _state(step=5):
    model, opt = _trained()
    names = {id(p): n for n, p in model.named_parameters()}
    tensors, meta = optimizer_state(opt, names)
    return model, opt, TrainingState(step=step, model=model.state_dict(), optimizer_tensors=tensors,
                                     optimizer_meta=meta, sampler={"seed": 1, "global_batch": 8, "dataset_len": 80},
                                     world_size=3, rng=torch.get_rng_state())


def test_round_trip_restores_model_and_optimizer(tmp_path):
    model, opt, state = _state()
    store = CheckpointStore(tmp_path)
    path = store.save(state)
    assert path.name == "step-00000005" and store.latest() == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005"]  # no temporary left
    loaded = store.load()
    assert loaded.step == 5 and loaded.world_size == 3 and loaded.sampler["global_batch"] == 8
    torch.manual_seed(123)
    model2 = mlp()
    model2.load_state_dict(loaded.model)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    load_optimizer_state(opt2, {id(p): n for n, p in model2.named_parameters()},
                         loaded.optimizer_tensors, loaded.optimizer_meta)
    for p, q in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
    # one more identical step from both gives identical parameters
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_checksum_mismatch_is_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.save(_state()[2])
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["optimizer.safetensors"]["sha256"] = "0" * 64
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="optimizer.safetensors.*does not match its sha256"):
        store.load()


def test_incomplete_checkpoint_is_ignored_and_old_ones_pruned(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3):
        store.save(_state(step)[2])
    (tmp_path / ".tmp-step-00000009-dead").mkdir()  # a crashed save: no rename happened
    (tmp_path / "step-00000010").mkdir()  # no manifest: not a checkpoint
    assert store.latest().name == "step-00000003"
    assert sorted(p.name for p in tmp_path.glob("step-0000000?")) == ["step-00000002", "step-00000003"]


def test_optimizer_state_keys_are_parameter_names_and_groups_survive():
    torch.manual_seed(0)
    model = mlp()
    opt = sgd_two_groups(model)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    tensors, meta = optimizer_state(opt, {id(p): n for n, p in model.named_parameters()})
    assert set(tensors) == {f"{n}/momentum_buffer" for n, _ in model.named_parameters()}
    assert meta["param_groups"][0]["params"] == ["0.weight", "0.bias"]
    assert meta["param_groups"][0]["lr"] == 0.05 and meta["param_groups"][1]["lr"] == 0.1
    other = torch.optim.SGD(model.parameters(), lr=0.1)  # one group: does not match
    with pytest.raises(CheckpointError, match="param groups do not match"):
        load_optimizer_state(other, {id(p): n for n, p in model.named_parameters()}, tensors, meta)
