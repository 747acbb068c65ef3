"""Adds the top-level keys of JSON objects to a results JSON in place: e.g. the Triton start times (ready_s,
first_answer_s, ...) to the bench JSON of the same device call.
    python3 bench/merge_json.py TARGET.json EXTRA.json [EXTRA.json ...]"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    target, *extras = (Path(arg) for arg in sys.argv[1:])
    record = json.loads(target.read_text())
    for extra in extras:
        added = json.loads(extra.read_text())
        clashes = sorted(set(added) & set(record))
        if clashes:  # a results file is never silently rewritten
            sys.exit(f"{extra}: keys already in {target}: {clashes}")
        record.update(added)
    target.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
