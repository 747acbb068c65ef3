"""bench/ab_report.py: bench/gpu.sh ab's logs (made up here, as bench.diag prints them) into a results JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

CALL_1 = """\
== base aaa
noise the diagnostic printed {'not': 'a figure'}
short6 {'new_ms': 5.0, 'same_ms': 4.0}
short6 64 clients pipelined {'rps': 300.0, 'p50_ms': 200.0, 'mean_batch': 20}
== this bbb
short6 {'new_ms': 5.5, 'same_ms': 4.2}
short6 64 clients pipelined {'rps': 290.0, 'p50_ms': 210.0, 'mean_batch': 22}
== this bbb
short6 {'new_ms': 5.3, 'same_ms': 4.4}
== base aaa
short6 {'new_ms': 5.2, 'same_ms': 4.0}
"""
CALL_2 = """\
== base aaa
scaling {'state_tokens': 2048, 'new_ms': 30.0}
scaling {'state_tokens': 4096, 'new_ms': 60.0}
== this bbb
scaling {'state_tokens': 2048, 'new_ms': 33.0}
scaling {'state_tokens': 4096, 'new_ms': 54.0}
"""


def test_runs_are_pooled_by_label_and_each_figure_compared(tmp_path: Path) -> None:
    logs = []
    for name, text in (("one.log", CALL_1), ("two.log", CALL_2)):
        (tmp_path / name).write_text(text)
        logs.append(tmp_path / name)
    out = tmp_path / "ab.json"
    printed = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "ab_report.py"),
            "--out",
            str(out),
            "--field",
            "gpu=NVIDIA H200",
            f"change={logs[0]}",
            f"change={logs[1]}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    record = json.loads(out.read_text())
    assert record["gpu"] == "NVIDIA H200" and list(record["measurements"]) == ["change"]
    measured = record["measurements"]["change"]
    assert [(run["call"], run["log"], run["side"], run["commit"]) for run in measured["runs"]] == [
        (1, "one.log", "base", "aaa"),
        (1, "one.log", "this", "bbb"),
        (1, "one.log", "this", "bbb"),
        (1, "one.log", "base", "aaa"),
        (2, "two.log", "base", "aaa"),
        (2, "two.log", "this", "bbb"),
    ]
    summary = measured["summary"]
    # medians over both sides' runs: base 5.0 and 5.2, this 5.5 and 5.3
    assert summary["short6: new_ms"] == {
        "base_median": 5.1, "this_median": 5.4, "change_pct": 5.88, "change_pct_by_log": [5.88], "runs": 4
    }  # fmt: skip
    # a figure only one run of each side printed (the later runs were cut short)
    assert summary["short6 64 clients pipelined: rps"]["change_pct"] == round((290 / 300 - 1) * 100, 2)
    # a name repeated in a run is numbered from its second line
    assert summary["scaling: new_ms"]["change_pct"] == 10.0
    assert summary["scaling #2: new_ms"]["change_pct"] == -10.0
    assert not any("not" in name for name in summary)
    assert "short6: new_ms" in printed and "+5.88 %" in printed


CALL_3 = """\
== base aaa
short6 {'new_ms': 10.0}
== this bbb
short6 {'new_ms': 10.2}
"""


def test_a_change_pooled_over_calls_is_the_mean_of_each_calls_own(tmp_path: Path) -> None:
    """A slower machine in one call moves both of its sides, not the pooled change: 5.88 % and 2 % give 3.94 %, where
    the medians over all runs (5.2 against 5.5) would say 5.77 %."""
    (tmp_path / "one.log").write_text(CALL_1)
    (tmp_path / "three.log").write_text(CALL_3)
    out = tmp_path / "ab.json"
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "ab_report.py"), "--out", str(out), f"{tmp_path / 'one.log'}",
         f"{tmp_path / 'three.log'}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    figure = json.loads(out.read_text())["measurements"]["ab"]["summary"]["short6: new_ms"]
    assert figure["change_pct_by_log"] == [5.88, 2.0] and figure["change_pct"] == 3.94
    assert (figure["base_median"], figure["this_median"]) == (5.2, 5.5)
