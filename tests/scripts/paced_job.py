"""A Ray job entrypoint for benchmarks/scenarios/test_ray_job.py: the MLP task with SGD, each micro-batch
paced by a sleep so a run lasts long enough to be killed mid-way (no longer once the file
named by the environment variable ``EDP_PACED_UNTIL`` exists).

    python -m tests.scripts.paced_job --workers 2 --steps 30 --storage DIR ...
"""

from __future__ import annotations

import os
import sys

from elastic_dp.cli import main
from tests.tasks import PacedLoss, paced_task

TASK = paced_task(PacedLoss(seconds=0.05, until=os.environ.get("EDP_PACED_UNTIL")))

if __name__ == "__main__":
    sys.exit(main(["train", "tests.scripts.paced_job", *sys.argv[1:]]))
