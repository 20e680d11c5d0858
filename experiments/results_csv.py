"""``python3 experiments/results_csv.py DIR OUT.csv``: a result folder's run files as one CSV that reads
in a diff, in place of an archive of JSON in git (docs/results/ keeps text, CSV and plots).

One row per bench result (its scalar fields and stage medians, without the per-request arrays), per
turn group of a chat run (measured and simulated) and per row of a stream-bench table; a chat run's
fitted costs go to ``OUT_costs.csv``. Lists of per-request values are left out: they stay in the
runner's output and in git history."""
from __future__ import annotations

import csv
import glob
import json
import os
import sys
from typing import Any, Iterator

Row = dict[str, Any]


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {x}" for k, x in v.items())
    if isinstance(v, list):
        return " ".join(str(x) for x in v)
    return v


def _scalars(d: dict, prefix: str = "") -> Row:
    return {prefix + k: _cell(v) for k, v in d.items() if not isinstance(v, (list, dict))}


def rows(run: str, r: dict) -> Iterator[tuple[str, Row]]:
    """(table, row) pairs of one run file; table "" is the main CSV, "costs" the costs CSV."""
    if "rows" in r:  # pushkv stream-bench: its table
        for row in r["rows"]:
            yield "", {"run": run, **{k: _cell(v) for k, v in row.items()}}
    elif "summary" in r:  # pushkv bench --workload chat: per turn group
        for row in r["summary"]:
            yield "", {"run": run, **{k: _cell(v) for k, v in row.items()}}
    elif "measured" in r:  # pushkv chat-sweep: per turn group, measured and simulated
        head = _scalars(r)
        for side in ("measured", "simulated"):
            for turn, row in r.get(side, {}).items():
                yield "", {"run": run, **head, "side": side, "turn": turn,
                           **{k: _cell(v) for k, v in row.items() if k != "turn"}}
        yield "costs", {"run": run, **head, **_scalars(r.get("costs", {}))}
    else:  # pushkv bench / sweep: the run's figures and its stage medians (ms)
        yield "", {"run": run, **_scalars(r), **_scalars(r.get("stages", {}), "stage.")}


def write(path: str, table: list[Row]) -> None:
    columns: list[str] = []
    for row in table:
        columns += [k for k in row if k not in columns]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        w.writerows(table)


def main(argv: list[str]) -> int:
    folder, out = argv
    tables: dict[str, list[Row]] = {}
    for p in sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)):
        with open(p) as f:
            r = json.load(f)
        for table, row in rows(os.path.relpath(p, folder).removesuffix(".json"), r):
            tables.setdefault(table, []).append(row)
    for table, found in tables.items():
        write(out if not table else out.removesuffix(".csv") + f"_{table}.csv", found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
