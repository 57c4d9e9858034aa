"""How sure a ratio measured in rounds is: a bootstrap interval of the median per-round ratio.

On a shared machine single rounds move by several percent, and a run's two usual figures
(the ratio of the medians, the median of the per-round ratios) can disagree by as much.
``round_ratio_interval`` resamples the rounds' ratios with replacement (a fixed seed, so
a run's JSON is reproducible from its rounds) and returns the 2.5th and 97.5th
percentiles of the resampled medians: a target is shown met when the interval's upper
end is within it, and shown missed when its lower end is beyond it.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def round_ratio_interval(ours: Sequence[float], theirs: Sequence[float], *, resamples: int = 10_000,
                         seed: int = 0) -> list[float]:
    """95% bootstrap interval of the median of ``ours[i] / theirs[i]`` over the rounds."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    if len(ratios) < 2:
        return [ratios[0], ratios[0]] if ratios else []
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return [round(medians[int(0.025 * resamples)], 3), round(medians[int(0.975 * resamples) - 1], 3)]
