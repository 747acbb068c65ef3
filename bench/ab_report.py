"""bench/gpu.sh ab's logs as a results JSON: every run's figures, and per figure the two sides' medians and this
side's change in percent.

    python3 bench/ab_report.py --out RESULT.json [--field KEY=VALUE ...] [LABEL=]LOG ...

A log (DIR/ab-STEP.log) holds runs, each opened by `== base REV` or `== this REV` and followed by the diagnostic's
lines of the form `NAME {python dict}` (`short6 {'new_ms': ...}`, `short6 64 clients pipelined {'rps': ...}`); a
number in a dict is the figure `NAME: key`. A name repeated within a run (the scaling step's points) is numbered
from its second line: `scaling #2: new_ms`. Logs given the same LABEL (several calls measuring one change, each on
its own machine) are pooled: a figure's change is the mean of each log's change (each side's median within the log),
so that a slower machine weighs on neither side; the medians shown are over all the label's runs. A run cut short
keeps the figures it printed. `--field` adds top-level keys (gpu, driver, command, ...).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
from pathlib import Path
from typing import Any

_HEADER = re.compile(r"^== (base|this) (\S+)")
_FIGURES = re.compile(r"^([A-Za-z0-9_ .-]+?) (\{.*\})$")


def parse_log(text: str) -> list[dict[str, Any]]:
    """The runs of one log, in order: {side, commit, figures: {NAME: key: value}}."""
    runs: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            runs.append({"side": header[1], "commit": header[2], "figures": {}})
            seen = {}
            continue
        figures = _FIGURES.match(line)
        if not figures or not runs:
            continue
        try:
            values = ast.literal_eval(figures[2])
        except (ValueError, SyntaxError):
            continue
        if not isinstance(values, dict):
            continue
        name = figures[1]
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name} #{seen[name]}"
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                runs[-1]["figures"][f"{name}: {key}"] = round(float(value), 4)
    return runs


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per figure both sides of these runs have: their medians and this side's change, percent of the base's."""
    sides: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
    for run in runs:
        for name, value in run["figures"].items():
            sides[run["side"]].setdefault(name, []).append(value)
    result = {}
    for name, base in sides["base"].items():
        this = sides["this"].get(name)
        if not this:
            continue
        b, t = statistics.median(base), statistics.median(this)
        result[name] = {
            "base_median": round(b, 4),
            "this_median": round(t, 4),
            "change_pct": round((t / b - 1) * 100, 2) if b else float("nan"),
            "runs": len(base) + len(this),
        }
    return result


def pooled(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """summary() over all `runs`, each figure's change replaced by the mean of its logs' own changes (listed in
    `change_pct_by_log`, log by log: a log without both sides of the figure has none, and a figure no log has both
    sides of is left out)."""
    by_log: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        by_log.setdefault(run["call"], []).append(run)
    changes: dict[str, list[float]] = {}
    for log_runs in by_log.values():
        for name, figure in summary(log_runs).items():
            changes.setdefault(name, []).append(figure["change_pct"])
    result: dict[str, dict[str, Any]] = {}
    for name, figure in summary(runs).items():
        if name not in changes:
            continue
        result[name] = figure | {
            "change_pct": round(statistics.mean(changes[name]), 2),
            "change_pct_by_log": changes[name],
        }
    return result


def report(logs: list[tuple[str, Path]], fields: dict[str, str]) -> dict[str, Any]:
    """The results JSON: `fields`, then per label its runs (each naming its log and the log's place among `logs`,
    `call`) and their summary."""
    labels: dict[str, list[dict[str, Any]]] = {}
    for call, (label, path) in enumerate(logs, 1):
        for run in parse_log(path.read_text()):
            labels.setdefault(label, []).append({"call": call, "log": path.name, **run})
    return dict(fields) | {
        "measurements": {label: {"summary": pooled(runs), "runs": runs} for label, runs in labels.items()}
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--field", action="append", default=[], metavar="KEY=VALUE", help="a top-level key")
    parser.add_argument("logs", nargs="+", metavar="[LABEL=]LOG")
    args = parser.parse_args(argv)
    fields = dict(field.split("=", 1) for field in args.field)
    logs = []
    for arg in args.logs:
        label, _, path = arg.rpartition("=")
        logs.append((label or "ab", Path(path)))
    result = report(logs, fields)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for label, measured in result["measurements"].items():
        print(f"== {label}: {len(measured['runs'])} runs")
        for name, figure in measured["summary"].items():
            base, this, change = figure["base_median"], figure["this_median"], figure["change_pct"]
            print(f"  {name:45s} {base:10.3f} -> {this:10.3f} {change:+6.2f} %")


if __name__ == "__main__":
    main()
