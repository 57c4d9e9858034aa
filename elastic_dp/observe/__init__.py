"""What a run shows: metrics.jsonl, events and the summary, TensorBoard and Ray metrics, elastic-dp report, elastic-dp plan (capacity.py)."""
