"""``--compress int8`` at ZeRO-2 on a Ray cluster through a kill and joins, on the replay that
simulates its members (tests.reference.replay_members with ZeRO's reduce-scatter). A long
scenario (``python3 dev.py test benchmarks/scenarios``, run by ``.ci/run``): the suite keeps
PowerSGD at ZeRO-2 through kills (tests/test_compression_ray.py) and int8 at ZeRO-2 on thread
ranks (tests/test_compression.py)."""

from __future__ import annotations

import pytest

from tests.reference import max_abs_diff
from tests.runs import fit

pytestmark = pytest.mark.ray

MLP_TOL = 1e-6  # as tests/test_compression.py's: int8 on the MLP's SGD, measured 0 to 3e-8 against its replay


def test_int8_at_zero_2_through_a_kill_and_a_join_ends_on_the_replay_that_simulates_its_members(ray_cluster,
                                                                                                 tmp_path):
    """ZeRO-2 with ``--compress int8``: each bucket reduce-scattered as int8 (one quantization,
    the owner's sum kept in fp32), each member's error fed back; rank 1 killed in step 3 (its
    error taken over from its copy) and workers joining: on ``replay_members``' reduce-scatter
    (``quantized_scatter_sum``, ZeRO's buckets padded to the members) through the same
    membership, on the MLP (SGD: the integers snap float order there; on the tiny GPT's AdamW
    ZeRO's own order noise, 1e-6 uncompressed, flips a rounding edge now and then:
    tests/test_compression.py)."""
    from tests.reference import replay_members
    from tests.tasks import MLP_TASK
    from tests.test_diloco_ray import one_thread

    run = fit(MLP_TASK, tmp_path, workers=3, min_workers=2, steps=10, micro_batch=None, compress="int8", zero=2,
              inject=["kill:step=3:rank=1", "join:step=6"])
    membership = [(c["step"], c.get("lost_ranks", []), c["joined"]) for c in run.changes()]
    assert membership[0][:2] == (3, [1]) and sum(j for _, _, j in membership) >= 1, membership
    initial = str(tmp_path / "initial.safetensors")
    world = next(e for e in run.events if e["kind"] == "group_formed")["world_size"]
    expected = one_thread(replay_members)(MLP_TASK, run.config, initial, world=world, changes=membership)
    assert max_abs_diff(run.weights(), expected) < MLP_TOL
    dropped = one_thread(replay_members)(MLP_TASK, run.config, initial, world=world, changes=membership,
                                         take_over=False)
    assert max_abs_diff(expected, dropped) > 10 * MLP_TOL
