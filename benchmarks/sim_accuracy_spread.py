"""How far two measured runs of the same cells lie apart: the floor under the simulator's error.

    .venv/bin/python benchmarks/sim_accuracy_spread.py first.json again.json

Both files are `benchmarks/sim_accuracy.py --output` files of the same workloads, rates and
seed (the same sessions and send times), measured one after the other on one machine. For
each (workload, deployment, metric) both runs hold, it prints the two measurements, the
second's difference from the first, and each run's prediction error; then how many cells
the two measurements hold within 15% of each other. A simulator cannot be held closer to
one run than the runs are to each other.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WITHIN = 0.15


def rows_by_cell(path: str) -> dict[tuple[str, str, str], dict]:
    rows = json.loads(Path(path).read_text())["rows"]
    return {(r["workload"], r["deployment"], r["metric"]): r for r in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("again")
    args = parser.parse_args()
    first, again = rows_by_cell(args.first), rows_by_cell(args.again)
    cells = [c for c in first if c in again]
    if not cells:
        sys.exit(f"{args.first} and {args.again} share no (workload, deployment, metric) cell")
    print(f"{'workload':<15}{'deployment':<12}{'metric':<13}{'first':>9}{'again':>9}"
          f"{'apart':>9}{'error 1':>9}{'error 2':>9}")  # fmt: skip
    apart = []
    for cell in cells:
        a, b = first[cell], again[cell]
        apart.append((b["measured"] - a["measured"]) / a["measured"])
        print(f"{cell[0]:<15}{cell[1]:<12}{cell[2]:<13}{a['measured']:>9.1f}{b['measured']:>9.1f}"
              f"{apart[-1]:>9.1%}{a['error']:>9.1%}{b['error']:>9.1%}")  # fmt: skip
    close = sum(abs(x) <= WITHIN for x in apart)
    print(f"measured runs within {WITHIN:.0%} of each other: {close}/{len(cells)}")
    for label, rows in (("first", first), ("again", again)):
        hits = sum(abs(rows[c]["error"]) <= WITHIN for c in cells)
        print(f"predictions within {WITHIN:.0%} of the {label} run (probed): {hits}/{len(cells)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
