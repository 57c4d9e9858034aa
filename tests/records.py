"""A run's JSON-lines files (metrics.jsonl, events.jsonl, updates.jsonl) as lists of dicts."""

from __future__ import annotations

import json
from pathlib import Path


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
