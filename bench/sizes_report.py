"""One Kev size's results from bench/gpu.sh sizes, merged into one JSON, and its short table.

    python bench/sizes_report.py SIZE WORK_DIR OUT.json

WORK_DIR holds what the script's steps wrote for SIZE: steps-SIZE.txt (a line per step: name, seconds, exit code),
bench-SIZE/*.json (python -m kev_backend.dev.bench), parity-SIZE/*.json (python -m kev_backend.dev.parity),
served-SIZE.json (loadtest/served.py), long-SIZE.json (loadtest/long_states.py), gemm-SIZE.json (the GEMM table),
facts-SIZE.json (the checkpoint's bytes on disk, the served GPU's memory), refuse-SIZE.json (starts on a GPU left
too small), frontdoor-SIZE.json (loadtest/frontdoor.py). A step that wrote nothing is left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def newest(pattern: str, directory: Path) -> dict[str, Any] | None:
    found = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text()) if found else None


def steps(path: Path) -> dict[str, dict[str, float]]:
    """name → {"s": seconds, "rc": exit code}, from `NAME SECONDS RC` lines."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        name, seconds, code = line.split()
        out[name] = {"s": float(seconds), "rc": int(code)}
    return out


def merged(size: str, work: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"size": size, "model": f"kev-{size}-shapes", "steps": steps(work / f"steps-{size}.txt")}
    parts = {
        "bench": newest("*.json", work / f"bench-{size}"),
        "parity": newest("*.json", work / f"parity-{size}"),
        "served": newest(f"served-{size}.json", work),
        "long_states": newest(f"long-{size}.json", work),
        "gemm_table": newest(f"gemm-{size}.json", work),
        "facts": newest(f"facts-{size}.json", work),
        "refuse": newest(f"refuse-{size}.json", work),
        "frontdoor": newest(f"frontdoor-{size}.json", work),
    }
    record |= {name: part for name, part in parts.items() if part is not None}
    for source in ("bench", "served", "parity"):
        if source in record:
            record |= {key: record[source][key] for key in ("gpu", "commit", "date") if key not in record}
    return record


def ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def table(record: dict[str, Any]) -> list[str]:
    """A few lines: the steps' seconds, the in-process figures, parity, the served figures, scaling, long states."""
    timings = ", ".join(f"{name} {step['s']:.0f} s (rc {step['rc']})" for name, step in record["steps"].items())
    lines = [f"{record['model']}: {timings}"]
    bench = record.get("bench")
    if bench:
        short, long = bench["workloads"].get("short6", {}), bench["workloads"].get("long5", {})
        lines.append(
            f"  in process: short6 new {ms(short.get('new_ms'))} same {ms(short.get('same_ms'))}, long5 new "
            f"{ms(long.get('new_ms'))} same {ms(long.get('same_ms'))}, short6 at 64 clients "
            f"{short.get('rps', {}).get('64', 0):.1f} req/s (floor {short.get('floor_rps', 0):.1f}); engine "
            f"{bench.get('engine_gpu_gib', 0):.1f} GiB, peak {bench.get('gpu_gib_peak', 0):.1f} GiB"
        )
        for point in bench["workloads"].get("scaling", []):
            lines.append(
                f"  scaling {point['state_tokens']:6d} tokens: new {ms(point['new_ms'])} same {ms(point['same_ms'])}"
                f" floor {ms(point['floor_ms'])} (sustained {ms(point.get('floor_sustained_ms'))})"
                f" GPU peak {point['gpu_gib'] or 0:.1f} GiB"
            )
        if "bank_capacity" in bench:
            room = bench["bank_capacity"]
            lines.append(
                f"  bank: {room['states']} states of {room['state_tokens']} tokens in {room['bank_gib']:.1f} GiB; "
                f"{room['hits_on_second_ask']} of {room['checked']} asked again were hits"
            )
    parity = record.get("parity")
    if parity:
        versus = parity["vs_reference"]
        depth = f" ({parity['layers']} of {parity['model_layers']} layers)" if "depth" in parity else ""
        lines.append(
            f"  parity{depth}: max |dp| {versus['max_abs']:.4f}, decided flips {versus['decided_flips']} of "
            f"{versus['decided_questions']}, alone {parity['alone_vs_batch']['max_abs']:.1e}, bank "
            f"{parity['bank_hit_vs_miss']['max_abs']:.1e}; bars met: {all(parity['verdict'].values())}"
        )
    served = record.get("served")
    if served:
        gpu = record.get("facts", {}).get("served_gpu_mib")
        lines.append(
            f"  served: ready {served['ready_s']:.1f} s, first answer {served['first_answer_s']:.1f} s, short6 one "
            f"client p50 {ms(served.get('short6_1c_p50_ms'))}, 64 clients {served.get('short6_64c_rps', 0):.1f} "
            f"req/s" + (f", GPU {gpu} MiB" if gpu else "")
        )
    door = record.get("frontdoor")
    if door:
        levels = door["grpc"]["levels"]
        ratios = door.get("served_over_inprocess", {})
        lines.append(
            f"  front door: one client {ms(door['grpc']['one_client_p50_ms'])} over gRPC (in process "
            f"{ms(door.get('inprocess', {}).get('one_request_wall_ms'))}), "
            + ", ".join(f"{n} clients {lv['rps']:.1f} req/s (x{ratios.get(n, 0):.2f})" for n, lv in levels.items())
        )
        if "gateway" in door:
            gateway = door["gateway"]
            lines.append(
                f"  gateway: one client +{door['gateway_one_client_added_ms']:.2f} ms, "
                + ", ".join(
                    f"{n} clients {level['rps']:.1f} req/s (x{door['gateway_over_grpc'].get(n, 0):.2f} of gRPC)"
                    for n, level in gateway["levels"].items()
                )
            )
    for start in record.get("refuse", []):
        lines.append(
            f"  refused ({start['case']}): exit {start['exit_code']} after {start['seconds']} s, "
            f"{start['restarts']} restarts: {(start['message'] or 'no message')[-160:]}"
        )
    long = record.get("long_states")
    if long:
        lines.append(
            f"  long states ({long['state_tokens']} tokens): alone {long['alone']['state_tokens_per_s']:.0f} tokens/s,"
            f" {long['concurrent']['states']} at once {long['concurrent']['state_tokens_per_s']:.0f} tokens/s "
            f"(x{long['speedup']:.2f})"
        )
    return lines


def main() -> None:
    size, work, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    record = merged(size, work)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(table(record)))


if __name__ == "__main__":
    main()
