"""Checkpoint files: written in parts by every rank, committed by the manifest, checksummed,
optimizer state keyed by parameter name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from elastic_dp import CheckpointError
from elastic_dp.durable.checkpoint import (
    CheckpointStore,
    TrainingState,
    cut_part,
    load_optimizer_state,
    manifest_of,
    optimizer_state,
    write_part,
)
from elastic_dp.durable.storage import Storage
from elastic_dp.durable.weights import save_tensor_parts
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


def _save(store: CheckpointStore, state: TrainingState, world_size: int = 3) -> str:
    """Save ``state`` as ``world_size`` replicated ranks would: each writes its part."""
    directory = store.begin(state.step)
    reports = [write_part(store.storage, directory, cut_part(state, rank, world_size)) for rank in range(world_size)]
    store.commit(directory, manifest_of(reports, step=state.step, sampler=state.sampler, world_size=world_size))
    return directory


def test_round_trip_restores_model_and_optimizer(tmp_path):
    model, opt, state = _state()
    store = CheckpointStore(str(tmp_path))
    directory = _save(store, state)
    assert directory.startswith("step-00000005-") and store.latest().directory == directory
    files = sorted(p.name for p in (tmp_path / directory).iterdir())
    assert files == ["manifest.json", *[f"{kind}-0000{r}.safetensors" for kind in ("model", "optim") for r in range(3)]]
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]  # no temporary left
    # every rank wrote about a third of the model: none wrote it alone
    index = store.latest().manifest["tensors"]
    pieces = [p for key, e in index.items() if key.startswith("model/") for p in e["pieces"]]
    per_rank = [sum(numel for file, _, numel in pieces if file == f"model-0000{r}.safetensors") for r in range(3)]
    total = sum(t.numel() for t in state.model.values())
    assert sum(per_rank) == total and max(per_rank) - min(per_rank) <= len(state.model)
    loaded = store.latest().read()
    assert loaded.step == 5 and loaded.world_size == 3 and loaded.sampler["global_batch"] == 8
    assert torch.equal(loaded.rng, state.rng)
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


def test_a_reader_reads_only_the_files_holding_pieces_it_wants(tmp_path, monkeypatch):
    _, _, state = _state()
    store = CheckpointStore(str(tmp_path))
    _save(store, state)
    read = []
    original = Storage.read
    monkeypatch.setattr(Storage, "read", lambda self, rel: read.append(rel.split("/")[-1]) or original(self, rel))
    checkpoint = store.latest()
    read.clear()
    partial = checkpoint.read(lambda key, start, numel: not key.startswith("optim/"))
    assert sorted(read) == [f"model-0000{r}.safetensors" for r in range(3)]
    assert all(torch.equal(partial.model[k], v) for k, v in state.model.items())


def test_checksum_mismatch_is_refused(tmp_path):
    store = CheckpointStore(str(tmp_path))
    directory = _save(store, _state()[2])
    part = tmp_path / directory / "optim-00001.safetensors"
    data = bytearray(part.read_bytes())
    data[-3] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="optim-00001.safetensors does not match its sha256"):
        store.latest().read()


def test_incomplete_checkpoint_is_ignored_and_old_ones_pruned(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    _save(store, _state(1)[2])
    (tmp_path / "step-00000001-abandoned").mkdir()  # a save that never got its manifest
    for step in (2, 3):
        _save(store, _state(step)[2])
    (tmp_path / "step-00000010-inflight").mkdir()  # no manifest: not a checkpoint (yet)
    assert store.latest().step == 3
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n.split("-")[1] for n in names] == ["00000002", "00000003", "00000010"]  # abandoned one pruned


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


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 4, generator=g), "b.bf16": torch.randn(5, generator=g).bfloat16(),
            "c": torch.arange(7), "flag": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
            "half": torch.randn(2, 2, generator=g).half(), "empty": torch.zeros(0, 3)}


def test_a_weights_file_written_in_parts_is_the_one_safetensors_reads(tmp_path):
    """Each dtype the models hold, a 0-d and an empty tensor, in two parts: safetensors'
    own reader gives them back exactly."""
    tensors = _tensors()
    specs = [(k, v.dtype, list(v.shape)) for k, v in tensors.items()]
    keys = list(tensors)
    parts = [{k: tensors[k] for k in keys[:3]}, {k: tensors[k] for k in keys[3:]}]
    save_tensor_parts(Storage(tmp_path), "w.safetensors", specs, iter(parts))
    back = load_file(tmp_path / "w.safetensors")
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())


def test_a_part_that_fails_or_does_not_match_the_specs_leaves_no_file(tmp_path):
    tensors = _tensors()
    specs = [(k, v.dtype, list(v.shape)) for k, v in tensors.items()]

    def failing():
        yield {"a": tensors["a"]}
        raise RuntimeError("a gather failed")

    with pytest.raises(RuntimeError, match="a gather failed"):
        save_tensor_parts(Storage(tmp_path), "w.safetensors", specs, failing())
    with pytest.raises(ValueError, match="where the specs have"):
        save_tensor_parts(Storage(tmp_path), "w.safetensors", specs, iter([{"c": tensors["c"]}]))
    assert list(tmp_path.iterdir()) == []
