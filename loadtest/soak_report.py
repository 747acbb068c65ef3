"""What a soak run (loadtest/soak.py) reports beside its record: each watched figure's growth after the warm-up, its
plot and its table."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from soak_watch import GAUGES

GROWTH_METRICS = ("gpu_memory_mb", "stub_rss_mb", "tritonserver_rss_mb", *GAUGES)


def period_quantile(before: dict[str, float] | None, after: dict[str, float] | None, q: float) -> float | None:
    """The q-quantile of a histogram's observations between two samples of its cumulative buckets, interpolated
    within the bucket that holds it as Prometheus' histogram_quantile does (None without observations; the highest
    finite bound when it falls in the +Inf bucket)."""
    if not after:
        return None
    bounds = sorted(after, key=lambda le: float(le))
    counts = [after[le] - (before or {}).get(le, 0.0) for le in bounds]
    total = counts[-1]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in zip(bounds, counts):
        upper = float(le)
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def server_latencies(samples: list[dict[str, Any]]) -> None:
    """Each sample's period quantiles from the servers' histograms (model_p50_ms, model_p99_ms, gateway_p99_ms), in
    place; the raw bucket counts are dropped from the samples once used."""
    previous: dict[str, Any] = {}
    for sample in samples:
        model, gateway = sample.pop("model_ms_buckets", None), sample.pop("gateway_s_buckets", None)
        sample["model_p50_ms"] = period_quantile(previous.get("model"), model, 0.5)
        sample["model_p99_ms"] = period_quantile(previous.get("model"), model, 0.99)
        p99_s = period_quantile(previous.get("gateway"), gateway, 0.99)
        sample["gateway_p99_ms"] = None if p99_s is None else round(p99_s * 1000, 2)
        previous = {"model": model or previous.get("model"), "gateway": gateway or previous.get("gateway")}


def summarize(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, float | None]]:
    """start (first sample after the warm-up, else the last), end (last sample), max, and growth end/start - 1."""
    first = next((s for s in samples if s["t_s"] >= warmup_s), samples[-1])
    last = samples[-1]
    out: dict[str, dict[str, float | None]] = {"growth": {}, "start": {}, "end": {}, "max": {}}
    for key in GROWTH_METRICS:
        start, end = first.get(key), last.get(key)
        values = [s[key] for s in samples if s.get(key) is not None]
        out["start"][key], out["end"][key] = start, end
        out["max"][key] = max(values) if values else None
        out["growth"][key] = round(end / start - 1, 4) if start and end is not None else None
    return out


LATENCIES = ("p50_ms", "p99_ms", "model_p50_ms", "model_p99_ms", "gateway_p99_ms")


def latency_drift(
    samples: list[dict[str, Any]], warmup_s: float, window: int = 5
) -> dict[str, dict[str, float | None]]:
    """Each latency after the warm-up: the median of its first `window` periods, of its last ones, and its worst
    period; flat when first and last agree."""
    after = [s for s in samples if s["t_s"] >= warmup_s] or samples[-1:]
    out: dict[str, dict[str, float | None]] = {}
    for key in LATENCIES:
        values = [s[key] for s in after if s.get(key) is not None]
        if not values:
            continue
        out[key] = {
            "first": statistics.median(values[:window]),
            "last": statistics.median(values[-window:]),
            "max": max(values),
        }
    return out


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float | None:
    """A counter's growth between two samples; None where either lacks it."""
    a, b = before.get(key), after.get(key)
    return None if a is None or b is None else b - a


def _ratio(numerator: float | None, denominator: float | None, scale: float = 1.0) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(scale * numerator / denominator, 3)


# The cumulative figures a window takes the growth of.
COUNTED = ("answered", "tokens_computed", "requests_scored", "stub_cpu_s", "host_busy_s", "host_cpu_s")


def windows(samples: list[dict[str, Any]], warmup_s: float, minutes: float = 10.0) -> list[dict[str, Any]]:
    """The run after its warm-up in windows of `minutes` (the last one may be shorter): the model's p50 and p99 from
    its histogram, and what the work cost, so that latency that moved can be told apart from a server whose work got
    dearer (stub CPU per computed token, per request) and from a host busier beside it (the host's busy share, the
    tokens computed per second, the median of the samples' host_probe_ms: a fixed piece of work's CPU time, which
    rises when the host's cores get slower). Needs the samples' histogram buckets: call it before server_latencies."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    out: list[dict[str, Any]] = []
    while len(after) > 1:
        end = next((i for i, s in enumerate(after) if s["t_s"] - after[0]["t_s"] >= 60 * minutes - 1), len(after) - 1)
        first, last = after[0], after[end]
        probes = [s["host_probe_ms"] for s in after[: end + 1] if s.get("host_probe_ms")]
        grew = {key: _delta(first, last, key) for key in COUNTED}
        seconds = last["t_s"] - first["t_s"]
        p50, p99 = (
            period_quantile(first.get("model_ms_buckets"), last.get("model_ms_buckets"), q) for q in (0.5, 0.99)
        )
        out.append({
            "from_min": round(first["t_s"] / 60, 2),
            "to_min": round(last["t_s"] / 60, 2),
            "answered": grew["answered"],
            "model_p50_ms": None if p50 is None else round(p50, 1),
            "model_p99_ms": None if p99 is None else round(p99, 1),
            "tokens_per_s": _ratio(grew["tokens_computed"], seconds),
            "stub_cpu_ms_per_request": _ratio(grew["stub_cpu_s"], grew["requests_scored"], 1000),
            "stub_cpu_s_per_ktoken": _ratio(grew["stub_cpu_s"], grew["tokens_computed"], 1000),
            "host_busy_share": _ratio(grew["host_busy_s"], grew["host_cpu_s"]),
            "host_probe_ms": round(statistics.median(probes), 3) if probes else None,
        })  # fmt: skip
        after = after[end:]
    return out


MIB = 1 << 20


def cost_per_period(samples: list[dict[str, Any]]) -> list[float | None]:
    """The stub's CPU milliseconds per request scored in each sample's period (None for the first, and where not
    measured); empty when no sample has them."""
    if not any(s.get("stub_cpu_s") is not None for s in samples):
        return []
    out: list[float | None] = [None]
    for before, after in zip(samples, samples[1:]):
        cpu, scored = _delta(before, after, "stub_cpu_s"), _delta(before, after, "requests_scored")
        out.append(_ratio(cpu, scored, 1000))
    return out


def plot(samples: list[dict[str, Any]], warmup_s: float, title: str, path: Path) -> None:
    """One panel per memory figure that was measured (bytes shown in MiB), one of p50/p99 latency and, where the
    server ran on this host, one of what the work cost per period (the stub's CPU per request, the host probe)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s["t_s"] / 60 for s in samples]
    panels = [key for key in GROWTH_METRICS if any(s.get(key) is not None for s in samples)]
    costs = cost_per_period(samples)
    shown = len(panels) + 1 + bool(costs)
    rows = (shown + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 2.6 * rows), squeeze=False, sharex=True)
    flat = list(axes.flat)
    for ax, key in zip(flat, panels):
        scale, unit = (MIB, "MiB") if key.endswith("_bytes") else (1, "MiB" if key.endswith("_mb") else "count")
        ax.plot(minutes, [None if s.get(key) is None else s[key] / scale for s in samples], ".-")
        ax.set_title(f"{key} ({unit})", fontsize=9)
    latency = flat[len(panels)]
    for key, style in (("p50_ms", ".-"), ("p99_ms", "^:"), ("model_p99_ms", "x--"), ("gateway_p99_ms", "s-.")):
        if any(s.get(key) is not None for s in samples):
            latency.plot(minutes, [s.get(key) for s in samples], style, label=key.removesuffix("_ms"))
    latency.set_title("latency per period (ms): the clients', the model's and the gateway's histograms", fontsize=9)
    latency.legend(fontsize=8)
    if costs:
        cost = flat[len(panels) + 1]
        cost.plot(minutes, costs, ".-", label="stub CPU per request")
        cost.plot(minutes, [s.get("host_probe_ms") for s in samples], "x:", label="host probe")
        cost.set_title("CPU ms per period: the stub's per request, the host probe", fontsize=9)
        cost.legend(fontsize=8)
    for ax in flat[shown:]:
        ax.set_visible(False)
    for ax in flat[:shown]:
        ax.axvline(warmup_s / 60, color="grey", lw=0.8, ls="--")  # the end of the warm-up: growth is from here
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelbottom=True)  # shared x, but a panel above a hidden one is its column's lowest
    flat[shown - 1].set_xlabel("minutes")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(record: dict[str, Any]) -> None:
    soak = record["soak"]
    print(
        f"soak {soak['elapsed_s'] / 60:.2f} min at {soak['rate']:g} r/s ({soak['shape']}): {soak['requests']} requests,"
        f" {soak['answered']} answered, {soak['expected_errors']} expected errors, {soak['disconnects']} disconnects,"
        f" {soak['refused_overload']} refused (overload), {soak['unexpected_errors']} unexpected"
        + (f", {soak['abandoned']} abandoned at a second stop signal" if soak["abandoned"] else "")
    )
    print(f"{'figure':<22} {'start':>14} {'end':>14} {'max':>14} {'growth':>8}")
    for key in GROWTH_METRICS:
        cells = [soak[part][key] for part in ("start", "end", "max")]
        growth = soak["growth"][key]
        digits = 1 if key.endswith("_mb") else 0
        text = [f"{c:14,.{digits}f}" if c is not None else f"{'-':>14}" for c in cells]
        change = f"{growth:+8.1%}" if growth is not None else f"{'-':>8}"
        print(f"{key:<22} {' '.join(text)} {change}")
    if soak.get("windows"):
        columns = (
            "model_p50_ms", "model_p99_ms", "tokens_per_s", "stub_cpu_ms_per_request", "host_busy_share",
            "host_probe_ms",
        )  # fmt: skip
        print(f"{'minutes':<12} " + " ".join(f"{c:>23}" for c in columns))
        for window in soak["windows"]:
            cells = [f"{window[c]:23,.2f}" if window[c] is not None else f"{'-':>23}" for c in columns]
            print(f"{window['from_min']:5.1f}-{window['to_min']:<6.1f} " + " ".join(cells))
    for example, count in soak["unexpected_examples"].items():
        print(f"unexpected ({count}x): {example}", file=sys.stderr)
