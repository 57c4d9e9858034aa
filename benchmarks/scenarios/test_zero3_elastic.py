"""ZeRO stage 3 through kills and a join on a local Ray cluster, out of the suite (its
time): every run ends where the plain PyTorch replay ends (tests.reference). Run with
``python3 dev.py test benchmarks/scenarios``."""

from __future__ import annotations

import pytest

from tests.test_elastic import run_against_replay

pytestmark = pytest.mark.ray

TOL = 2e-5  # float32 reduction order; worst measured 3.5e-06 (6 tests here, one scenario run on 2026-12-04, python -m tests.noise): 6x margin
"""Stage 0's bound on the tiny GPT (tests/test_elastic.py): float32 order noise of AdamW
over 9 steps."""


def test_kills_in_the_forward_and_the_backward_and_a_join_under_zero3_end_on_the_replay(ray_cluster, tmp_path):
    """Rank 1 is killed in step 2's forward (its peers wait in a unit's all-gather), a
    worker joins at step 4 (the units re-cut from the live chunks), and rank 0 is killed
    in step 6's backward (the reduce-scatters of the units in flight). Each lost step is
    re-run from the chunks the survivors hold, nothing from a checkpoint."""
    inject = ["kill:step=2:rank=1:phase=forward", "join:step=4", "kill:step=6:rank=0:phase=allreduce"]
    summary, diff, events, metrics = run_against_replay(tmp_path, 3, inject, min_workers=1, steps=9,
                                                  train={"zero": 3, "micro_batch": None})
    assert diff < TOL
    changes = [e for e in events if e["kind"] == "membership_changed"]
    failures = [c for c in changes if c["lost"]]
    assert [c["lost_ranks"] for c in failures] == [[1], [0]]
    assert all(c["restored_step"] == c["step"] and c["steps_rerun"] == 1 for c in failures)
    assert any(c.get("joined") for c in changes)
    assert not any(e["kind"] == "restored_from_checkpoint" for e in events)
    assert summary.steps == 9
    memory = {e["generation"]: e["ranks"] for e in events if e["kind"] == "state_memory"}
    assert set(memory) == {m["generation"] for m in metrics}
    for ranks in memory.values():  # the parameters sharded: every rank holds about 1/N of them
        assert max(r["parameters"] for r in ranks) <= 1.1 * min(r["parameters"] for r in ranks) + 4096


def test_kills_at_the_gathers_and_the_update_under_zero3_end_on_the_replay(ray_cluster, tmp_path):
    """Rank 1 is killed as it all-gathers a unit in step 1's forward, a worker joins at step
    3, rank 0 is killed as it gathers a unit again in step 4's backward, and rank 1 after
    step 6's vote (in its update). At least 2 workers: each kill leaves a peer waiting in
    the collective. The gathers' losses re-run their step from the live chunks; the
    update's comes after the commit, and the step counts as trained. Nothing is restored
    from a checkpoint."""
    inject = ["kill:step=1:rank=1:phase=gather_forward", "join:step=3", "kill:step=4:rank=0:phase=gather_backward",
              "kill:step=6:rank=1:phase=optimizer"]
    summary, diff, events, _ = run_against_replay(tmp_path, 3, inject, min_workers=2, steps=9,
                                                  train={"zero": 3, "micro_batch": None})
    assert diff < TOL
    failures = [e for e in events if e["kind"] == "membership_changed" and e["lost"]]
    assert [(c["step"], c["lost_ranks"]) for c in failures] == [(1, [1]), (4, [0]), (6, [1])]
    assert all(c["steps_rerun"] == 1 for c in failures[:2])
    assert not any(e["kind"] in ("restored_from_checkpoint", "fault_not_fired") for e in events)
    assert summary.steps == 9


def test_kills_at_the_snapshot_the_checkpoint_its_upload_the_evaluation_and_the_re_form_under_zero3(ray_cluster,
                                                                                                   tmp_path):
    """The phases outside the forward and the backward, under stage 3, in one run of 3
    workers (at least 2): rank 1 killed as it sends its snapshot after step 1, rank 0 as it
    copies its checkpoint part after step 3 and rank 1 as it uploads its part after step
    5 (each such save is abandoned, never half-written), rank 0 as it evaluates after step
    7, and in step 9 rank 1 in its forward and then rank 0 as it joins the group re-formed
    after that. The run ends on the replay, each lost chunk restored from its peer snapshot."""
    from elastic_dp import CheckpointConfig

    inject = ["kill:step=1:rank=1:phase=snapshot", "kill:step=3:rank=0:phase=checkpoint",
              "kill:step=5:rank=1:phase=upload", "kill:step=7:rank=0:phase=eval",
              "kill:step=9:rank=1:phase=forward", "kill:step=9:rank=0:phase=reform"]
    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=2)
    summary, diff, events, _ = run_against_replay(tmp_path / "out", 3, inject, min_workers=2, steps=11,
                                                  checkpoint=ckpt,
                                                  train={"zero": 3, "micro_batch": None, "eval_every": 8})
    assert diff < TOL
    assert not any(e["kind"] in ("restored_from_checkpoint", "fault_not_fired") for e in events), [
        e for e in events if e["kind"] == "fault_not_fired"]
    lost = [e for e in events if e["kind"] == "membership_changed" and e["lost"]]
    assert len(lost) >= 5  # the re-form's loss may be folded into the forward's
    assert any(e["kind"] == "checkpoint_abandoned" for e in events)
    assert summary.steps == 11


def test_two_adjacent_workers_lost_under_zero3_fall_back_to_the_checkpoint_read_by_chunk(ray_cluster, tmp_path):
    """Ranks 1 and 2 of 3 killed as step 3 starts (at stage 3 the forward's gathers are
    collectives: each must die before its first): rank 1's chunk and its peer snapshot (on rank
    2, its right neighbour) are both gone, so the survivor and the replacements load step
    2's checkpoint, each reading only its chunks of it, and say so; the run ends on the
    replay."""
    from elastic_dp import CheckpointConfig

    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=2, asynchronous=False)
    summary, diff, events, _ = run_against_replay(tmp_path / "out", 3, ["kill:step=3:rank=1", "kill:step=3:rank=2"],
                                                  min_workers=1, steps=6, checkpoint=ckpt,
                                                  train={"zero": 3, "micro_batch": None})
    assert diff < TOL
    restored = next(e for e in events if e["kind"] == "restored_from_checkpoint")
    assert restored["step"] == 2 and restored["lost_ranks"] == [1, 2]
    assert "ZeRO chunk and its peer snapshot" in restored["decision"]


def test_a_worker_that_hangs_in_a_backward_gather_under_zero3_is_found_and_replaced(ray_cluster, tmp_path):
    """Rank 1 stops (SIGSTOP) as it gathers a unit again in step 3's backward; its peer
    waits in that gather. Its missed heartbeats find it within the 5 s heartbeat timeout,
    the survivor's gather is released, the group re-forms without it and re-runs step 3 from
    the live chunks; the run ends on the replay."""
    summary, diff, events, _ = run_against_replay(tmp_path, 2, ["hang:step=3:rank=1:phase=gather_backward"],
                                                  min_workers=1, steps=6, train={"zero": 3, "micro_batch": None})
    assert diff < TOL
    lost = [e for e in events if e["kind"] == "membership_changed" and e["lost"]]
    assert len(lost) == 1 and lost[0]["lost_ranks"] == [1] and lost[0]["step"] == 3
    assert "heartbeat" in lost[0]["cause"] and lost[0]["detect_s"] < 10.0, lost[0]
    assert not any(e["kind"] == "restored_from_checkpoint" for e in events)
    assert summary.steps == 6


def test_a_hugging_face_llama_at_zero3_built_on_the_meta_device_ends_on_the_replay(ray_cluster, tmp_path):
    """jobs.hf_causal_lm's tiny Llama (tests/test_hf_job.py's) at stage 3: built on the meta
    device and initialised unit by unit by the model's own ``_init_weights`` (its rotary
    table a buffer of the factory's), its decoder layers the units, through a kill and a
    join; the plain replay from the initial weights the run wrote."""
    import dataclasses

    from safetensors.torch import load_file

    from elastic_dp import ClusterConfig, Trainer
    from jobs.hf_causal_lm import make_task
    from tests.records import read_lines
    from tests.reference import max_abs_diff, replay
    from tests.test_hf_job import TINY

    task = make_task("llama", TINY["llama"], context=16, lr=3e-3)
    config = dataclasses.replace(task.defaults, steps=6, global_batch=8, micro_batch=4, warmup_steps=2,
                                 decay_steps=6, zero=3)
    Trainer(task, train=config, cluster=ClusterConfig(workers=3, min_workers=1), out_dir=str(tmp_path),
            progress=False, inject=["kill:step=2:rank=1", "join:step=4"]).fit()
    changes = [e for e in read_lines(tmp_path / "events.jsonl") if e["kind"] == "membership_changed"]
    assert sum(e["lost"] for e in changes) == 1 and sum(e.get("joined", 0) for e in changes) >= 1
    initial = load_file(tmp_path / "initial.safetensors")
    final = load_file(tmp_path / "final.safetensors")
    assert max_abs_diff(final, replay(task, config, str(tmp_path / "initial.safetensors"))) < TOL
    assert max_abs_diff(final, initial) > 1e-3
    std = float(initial["model.layers.0.self_attn.q_proj.weight"].std())
    assert 0.015 < std < 0.025, std  # the model's own initializer_range (0.02), not an uninitialised buffer
