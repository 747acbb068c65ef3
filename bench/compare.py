"""Compare bench runs: `python bench/compare.py bench/results/*nvidia-h200*.json` prints one row per run and workload
(latency new/same, requests/s at each client count, floors), oldest first, so a change's effect reads down a column.

Reads the JSON that `python -m kev_backend.dev.bench` writes (top-level gpu, date, commit, checkpoint, workloads:
{name: {new_ms, same_ms, rps: {clients: requests/s}, floor_rps, baseline_rps}}); other JSON files are skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    runs = []
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("workloads"), dict) and "commit" in record:
            runs.append(record)
    return sorted(runs, key=lambda r: (r.get("date", ""), r["commit"]))


def rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    clients = sorted({c for r in runs for w in r["workloads"].values() for c in w.get("rps", {})}, key=int)
    header = ["commit", "variant", "workload", "new ms", "same ms", *(f"{c}c r/s" for c in clients), "floor r/s"]
    table = [header]
    for run in runs:
        choices = (
            ("graphs", run.get("graphs")),
            ("partial", run.get("complete") is False),  # a run cut short: some workloads missing
        )
        variant = "+".join(name for name, on in choices if on)
        for name, w in run["workloads"].items():
            rps = w.get("rps", {})
            table.append(
                [
                    run["commit"][:8],
                    variant or "-",
                    name,
                    f"{w['new_ms']:.1f}",
                    f"{w['same_ms']:.1f}",
                    *(f"{rps[c]:.1f}" if c in rps else "" for c in clients),
                    f"{w.get('floor_rps', 0):.0f}",
                ]
            )
    return table


def render(table: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    runs = load_runs(args.files)
    if not runs:
        raise SystemExit("no bench results among the files given")
    print(render(rows(runs)))


if __name__ == "__main__":
    main()
