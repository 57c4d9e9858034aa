"""jobs/hf_causal_lm.py: Hugging Face causal LMs built from their configurations (nothing
downloaded), with dict batches and the model's own loss: a model type transformers does not
know refused, a Mixtral at ZeRO-3 built on the meta device. (GPT-2 and a Llama through a
kill and a join, on the plain replay: benchmarks/scenarios/test_hf_models.py.) Needs
transformers (the test extra, which the README's test command installs); in the ray tier,
so that the quick tier needs neither."""

from __future__ import annotations

import dataclasses

import pytest
from safetensors.torch import load_file

from elastic_dp import TaskError
from tests.reference import max_abs_diff, replay

# jobs.hf_causal_lm imports transformers, which the quick tier does without: imported in the tests
pytestmark = pytest.mark.ray

TOL = 2e-5  # float32 reduction order over 6 AdamW steps (as the GPT job's tests)
# worst measured 4.3e-06 (2 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 5x margin

TINY = {"llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "max_position_embeddings": 32},
        "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 32}}


def test_a_model_type_transformers_does_not_know_is_refused_naming_the_variable():
    from jobs.hf_causal_lm import make_task

    with pytest.raises(TaskError, match="HF_MODEL=no-such-model is neither a model type transformers knows"):
        make_task("no-such-model")


TINY_MIXTRAL = {**TINY["llama"], "num_local_experts": 4, "num_experts_per_tok": 1}


def test_a_mixtral_at_zero_3_is_built_on_the_meta_device_by_its_own_init_weights_with_no_init_module(tmp_path):
    """A Hugging Face model needs no ``init_module`` at ``--zero 3``: its router, fused
    experts and norms have no ``reset_parameters()``, and the rule takes the model's own
    ``_init_weights``. 2 thread ranks build it on the meta device unit by unit; after 4
    AdamW steps it ends where the plain replay from the rule's initial parameters ends
    (written out in plain torch: tests/test_zero3_init.py's ``by_the_rule``)."""
    from safetensors.torch import save_file

    from jobs.hf_causal_lm import make_task
    from tests.test_zero3_init import by_the_rule
    from tests.zero_runs import train

    task = make_task("mixtral", TINY_MIXTRAL, context=16, lr=3e-3)
    assert task.init_module is None
    config = dataclasses.replace(task.defaults, steps=4, global_batch=8, micro_batch=4, zero=3, warmup_steps=0,
                                 lr_schedule="constant")
    assert config.init_by_units  # --init auto: units at stage 3
    final, _, _ = train(task, config, 2, range(config.steps), None)
    save_file(by_the_rule(task, config.seed), tmp_path / "initial.safetensors")
    initial = load_file(tmp_path / "initial.safetensors")
    assert float(initial["model.layers.0.mlp.gate.weight"].std()) > 0  # the router was drawn, not left empty
    expected = replay(task, config, str(tmp_path / "initial.safetensors"))
    # measured 1.24e-5, the same in 3 runs (thread ranks, 2026-12-04): top-1 routing over a 2-way
    # float sum, more than the dense models' 4e-6; 1e-4 is 8x that, and the 4 steps moved it 1.25e-2
    assert max_abs_diff(final, expected) < 1e-4
    assert max_abs_diff(final, initial) > 1e-3, "training moved the model"
