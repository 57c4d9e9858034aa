"""The suite's float noise, as measured: the worst ``max_abs_diff`` of each test at each
place it compares (the caller's file and line), over the runs recorded in a file
(``EDP_RECORD_DIFFS=FILE python3 dev.py test``, as often as wanted). Each tight bound (1e-4 or less) in the suite says in
a comment what this measured and the margin.

    python -m tests.noise FILE [--runs N]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--runs", type=int, default=None, help="how many suite runs the file holds (for the table)")
    args = parser.parse_args()
    worst: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    for line in open(args.file):
        record = json.loads(line)
        key = record["test"], record.get("at", "?")  # the test, and where it compared
        worst[key] = max(worst[key], record["diff"])
        calls[key] += 1
    by_site: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for (test, at), diff in worst.items():
        by_site[at].append((diff, test))
    for at in sorted(by_site):
        diffs = sorted(by_site[at], reverse=True)
        print(f"{at}: worst {diffs[0][0]:.2e} ({diffs[0][1].split('::', 1)[-1]}), {len(diffs)} tests")
        for diff, test in diffs:
            print(f"    {diff:.2e}  {test.split('::', 1)[-1]}  ({calls[test, at]} figures)")


if __name__ == "__main__":
    main()
