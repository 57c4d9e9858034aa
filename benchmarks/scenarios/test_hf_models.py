"""Hugging Face causal LMs beyond the suite's GPT-2 (tests/test_hf_job.py): a tiny Llama
(grouped-query attention, rotary positions, a gated MLP) built from its configuration,
through a kill and a join, on the plain replay, as the suite runs GPT-2. In the scenarios
for the suite's time (18 s on 2 cores); .ci/run runs them."""

from __future__ import annotations

import pytest

from tests.test_hf_job import test_a_tiny_model_from_its_config_through_a_kill_and_a_join_ends_on_the_replay as run

pytestmark = pytest.mark.ray


def test_a_tiny_llama_through_a_kill_and_a_join_ends_on_the_replay(ray_cluster, tmp_path):
    run(ray_cluster, tmp_path, "llama")
