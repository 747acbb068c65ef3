"""Sizing and autoscaling of Kev on Triton from measured service curves, by simulation (loadtest/simulate.py): each
replica's service model fitted to the measurements (the bench's curves, Triton's door, the open-loop p50s, the soak),
checked against them, then for each traffic shape the fewest replicas and the autoscaler target that keep its p99
within bounds through a burst.

    python loadtest/sizing.py MEASURED --out out/sizing            # the table: every shape, JSON + PNG
    python loadtest/sizing.py MEASURED --shape short6 --base-rps 500 --burst 4 --min-replicas 4 --target-ms 20 \
        --out out/sim                                                # one scenario

MEASURED: --bench, --triton, --openloop-short6, --openloop-mix and --soak, the measurements' JSON files (Measured;
docs/operations.md names the ones its figures come from).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from simulate import LONG5_TOKENS, SHORT6_TOKENS, Autoscaler, Result, ServiceModel, Traffic, simulate


# ------------------------------------------------------------------------------------------------- the measured curves
@dataclass(frozen=True)
class Measured:
    """The measurements the service model is fitted to and checked against (the arguments of the same names)."""

    bench: Path  # python -m kev_backend.dev.bench: short6 and long5 requests/s at 1 / 8 / 32 / 64 clients
    triton: Path  # the same engine through Triton's gRPC door: 64 clients (`grpc`) and one (`grpc_1c`)
    openloop_short6: Path  # loadtest/openloop.py, short6: p50 at each offered rate
    openloop_mix: Path  # loadtest/openloop.py, the jevbench mix
    soak: Path  # loadtest/soak.py: the mix at a fixed rate, p50 and p99 per 10 s sample

    def openloops(self) -> dict[str, Path]:
        return {"short6": self.openloop_short6, "mix": self.openloop_mix}


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def mix_shares() -> tuple[float, ...]:
    """Each jevbench-240 case's place between short6 and long5, by the length of its request JSON (a proxy for its
    tokens: short6 218, long5 2,630), clipped at 0 (none is shorter than short6)."""
    from kev_backend.dev.workloads import jevbench_cases, long5, short6

    short, long = len(json.dumps(short6(0))), len(json.dumps(long5(0)))
    return tuple(max(0.0, (len(json.dumps(case)) - short) / (long - short)) for case in jevbench_cases())


def one_replica(model: ServiceModel, rate: float, seed: int = 1, seconds: float = 120.0) -> dict[str, float]:
    """One replica under Poisson arrivals at `rate`: the medians of its 10 s windows' p50 and p99 after 20 s, and of
    the queue-time metric (ms, Triton's) after 60 s."""
    res = simulate(model, Traffic(rate, duration=seconds), Autoscaler(kind="none"), seed)
    lat = [w for w in res.windows if w["t_s"] >= 20 and w["p50_ms"] is not None]
    queue = [s["metric"] for s in res.scaling if s["t_s"] >= 60 and s["metric"] is not None]
    return {
        "p50_ms": round(float(np.median([w["p50_ms"] for w in lat])), 1) if lat else math.inf,
        "p99_ms": round(float(np.median([w["p99_ms"] for w in lat])), 1) if lat else math.inf,
        "queue_ms": round(float(np.median(queue)), 1) if queue else math.nan,
    }


def solve(f: Any, lo: float, hi: float, goal: float, steps: int = 14) -> float:
    """x in [lo, hi] (geometric bisection) where the increasing f(x) reaches goal."""
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if f(mid) < goal else (lo, mid)
    return math.sqrt(lo * hi)


def measured_models(measured: Measured) -> tuple[dict[str, ServiceModel], dict[str, Any]]:
    """The service model of each shape from the measurements, and where each number came from."""
    bench = load(measured.bench)["workloads"]
    triton = load(measured.triton)
    conc = (1.0, 8.0, 32.0, 64.0)
    short_rps = tuple(bench["short6"]["rps"][str(int(c))] for c in conc)
    long_rps = tuple(bench["long5"]["rps"][str(int(c))] for c in conc)
    grpc = triton["grpc"]
    host_s = 1.0 / grpc["rps"] - 1.0 / short_rps[-1]  # Triton's gRPC door: 279 against 312 req/s in process at 64
    door_s = triton["grpc_1c"]["p50_ms"] / 1000.0 - (1.0 / short_rps[0] + host_s)  # one client: 10.7 ms end to end
    wait_ms = 1000.0 * 64 / grpc["rps"] - triton["grpc_1c"]["p50_ms"]  # mean wait at 64 clients (Little)
    queue_share = grpc["server"]["queue_ms"] / wait_ms
    shares = mix_shares()
    base = ServiceModel(conc, short_rps, long_rps, host_s=host_s, door_s=door_s, queue_share=queue_share)
    # A closed loop of c clients keeps fewer than c requests in the server (the rest are on their way): the
    # concurrency scale is fitted so one simulated replica gives the measured short6 open-loop p50.
    short_point = load(measured.openloop_short6)["rates"][-1]
    scale = solve(
        lambda g: one_replica(replace(base, conc_scale=g), short_point["offered_rps"])["p50_ms"],
        0.1,
        1.0,
        short_point["p50_ms"],
    )
    base = replace(base, conc_scale=scale)
    # The mix by length alone (mean ~491 tokens) answers faster than measured: its cost is scaled by one factor so
    # one simulated replica gives the soak's p50 at 100 req/s (the loaded regime that sizing is about).
    mix_point = load(measured.openloop_mix)["rates"][-1]
    soak = load(measured.soak)["soak"]
    soak_p50 = float(np.median([s["p50_ms"] for s in soak["samples"] if s.get("p50_ms")]))
    mix = replace(base, mix=shares)
    factor = solve(lambda m: one_replica(replace(mix, cost_scale=(m, m)), soak["rate"])["p50_ms"], 0.5, 10.0, soak_p50)
    low = high = factor
    models = {
        "short6": replace(base, mix=(0.0,)),
        "long5": replace(base, mix=(1.0,)),
        "mix": replace(mix, cost_scale=(low, high)),
    }
    sources = {
        "curves": f"{measured.bench}: workloads.short6/long5.rps at 1/8/32/64 clients",
        "short6_rps": short_rps,
        "long5_rps": long_rps,
        "host_ms": round(1000 * host_s, 3),
        "door_ms": round(1000 * door_s, 3),
        "queue_share": round(queue_share, 4),
        "from": f"{measured.triton}: grpc rps {grpc['rps']:.1f}, queue_ms {grpc['server']['queue_ms']:.1f}, "
        f"grpc_1c p50 {triton['grpc_1c']['p50_ms']:.2f} ms",
        "conc_scale": round(scale, 4),
        "conc_scale_from": f"short6 open loop {short_point['offered_rps']:g} req/s: p50 {short_point['p50_ms']:.1f} ms",
        "mix_cost_scale": round(factor, 3),
        "mix_cost_scale_from": f"soak {soak['rate']:g} req/s p50 {soak_p50:.1f} ms "
        f"(mix open loop {mix_point['offered_rps']:g} req/s, p50 {mix_point['p50_ms']:.1f} ms, is a check)",
        "mix_share_mean": round(float(np.mean(shares)), 4),
        "mix_tokens_mean": round(SHORT6_TOKENS + float(np.mean(shares)) * (LONG5_TOKENS - SHORT6_TOKENS)),
        "capacity_rps": {k: round(m.capacity(), 1) for k, m in models.items()},
    }
    return models, sources


def checks(models: dict[str, ServiceModel], measured: Measured) -> list[dict[str, Any]]:
    """One simulated replica against the measured open-loop points (p50s fitted, p99s and queue times not)."""
    points = []
    for shape, path in measured.openloops().items():
        for rate in load(path)["rates"]:
            points.append((shape, rate["offered_rps"], rate, str(path)))
    soak = load(measured.soak)["soak"]
    samples = [s for s in soak["samples"] if s.get("p99_ms")]
    points.append(
        (
            "mix",
            soak["rate"],
            {
                "p50_ms": float(np.median([s["p50_ms"] for s in samples])),
                "p99_ms": float(np.median([s["p99_ms"] for s in samples])),
                "queue_ms": None,
            },
            f"{measured.soak} (median of its 10 s samples; 30 % through the gateway)",
        )
    )
    out = []
    for shape, rate, measured, source in points:
        model = models[shape]
        simulated = one_replica(model, rate) | {"utilization": round(rate / model.capacity(), 3)}
        measured = {
            k: None if measured.get(k) is None else round(measured[k], 1) for k in ("p50_ms", "p99_ms", "queue_ms")
        }
        out.append(
            {"shape": shape, "offered_rps": rate, "source": source, "measured": measured, "simulated": simulated}
        )
    return out


# ----------------------------------------------------------------------------------------------------- sizing search
def passes(res: Result, limit_ms: float = 500.0) -> bool:
    return res.summary["refused"] == 0 and all((w["p99_ms"] or 0.0) <= limit_ms for w in res.windows)


def size(
    model: ServiceModel, base: float, scaler: Autoscaler, targets: list[float], seed: int
) -> tuple[int, float, Result, Result]:
    """The fewest min replicas that keep every 10 s p99 under 500 ms, with nothing refused, through a 2x burst (the
    search starts where the base load is under 90 % of capacity); among the targets that pass there, the one whose
    4x burst costs the fewest seconds over 500 ms (then the largest target: fewest replicas)."""
    start = max(1, math.ceil(base / (0.9 * model.capacity())))
    for n in range(start, scaler.max_replicas + 1):
        passing = []
        for target in sorted(targets, reverse=True):
            chosen = replace(scaler, min_replicas=n, target=target)
            res = simulate(model, Traffic(base, burst=2.0), chosen, seed)
            if passes(res):
                passing.append((target, res, simulate(model, Traffic(base, burst=4.0), chosen, seed)))
        if passing:
            target, burst2, burst4 = min(passing, key=lambda p: (p[2].summary["seconds_above_500ms"], -p[0]))
            return n, target, burst2, burst4
    raise RuntimeError("no configuration up to max_replicas keeps p99 under 500 ms")


def plot(results: dict[str, Result], title: str, path: Path, limit_ms: float = 500.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(7.5, 6.5), sharex=True)
    for label, res in results.items():
        t = [w["t_s"] for w in res.windows]
        top.plot(t, [w["p99_ms"] if w["p99_ms"] is not None else np.nan for w in res.windows], label=label)
        mid.step(t, [w["replicas"] for w in res.windows], where="post", label=f"{label} asked")
        mid.step(t, [w["ready"] for w in res.windows], where="post", linestyle=":", label=f"{label} ready")
        low.plot(t, [w["refused"] / 10.0 for w in res.windows], label=label)
    top.axhline(limit_ms, color="grey", linestyle="--", linewidth=0.8)
    top.set_yscale("log")
    top.set_ylabel("p99 per 10 s (ms)")
    top.legend(fontsize=7)
    top.set_title(title, fontsize=9)
    mid.set_ylabel("replicas")
    mid.legend(fontsize=6, ncol=2)
    low.set_ylabel("refused (req/s)")
    low.set_xlabel("time (s)")
    for ax in (top, mid, low):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def slim(res: Result) -> dict[str, Any]:
    return {"summary": res.summary, "windows": res.windows}


def autoscaler(args: argparse.Namespace, **given: Any) -> Autoscaler:
    """The autoscaler the command line describes (metric, timings, replica cap), with `given` on top."""
    return Autoscaler(
        metric=args.metric,
        schedule_s=args.schedule_s,
        ready_s=args.ready_s,
        window_s=args.window_s,
        lag_s=args.lag_s,
        down_window_s=args.down_window_s,
        max_replicas=args.max_replicas,
        **given,
    )


def sizing(args: argparse.Namespace) -> None:
    models, sources = measured_models(measured(args))
    model_checks = checks(models, measured(args))
    scaler = autoscaler(args)
    table = []
    for shape in args.shapes:
        model, base = models[shape], args.base[shape]
        n, target, burst2, burst4 = size(model, base, scaler, args.targets, args.seed)
        chosen = replace(scaler, min_replicas=n, target=target)
        # the same floor on an empty kernel cache (32.3 s to ready)
        burst4_cold = simulate(model, Traffic(base, burst=4.0), replace(chosen, ready_s=32.3), args.seed)
        # KEDA from zero: idle, then the base load at t = 60 s
        keda = replace(chosen, kind="keda", min_replicas=0)
        zero = simulate(model, Traffic(base, start_at=60.0, duration=600.0), keda, args.seed)
        row = {
            "shape": shape,
            "base_rps": base,
            "replica_capacity_rps": round(model.capacity(), 1),
            "min_replicas": n,
            "target": target,
            "metric": args.metric,
            "burst2": burst2.summary,
            "burst4": burst4.summary,
            "burst4_empty_kernel_cache": burst4_cold.summary,
            "keda_from_zero": zero.summary,
        }
        table.append(row)
        print(json.dumps({k: row[k] for k in ("shape", "base_rps", "min_replicas", "target")}), flush=True)
        out = Path(f"{args.out}-{shape}")
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "what": "loadtest/sizing.py: the sizing of one traffic shape from the measured H200 curves",
            "command": " ".join(["python", "loadtest/sizing.py", *sys.argv[1:]]),
            "seed": args.seed,
            "model": sources,
            "service": asdict(model) | {"mix": f"{len(model.mix)} values, mean {np.mean(model.mix):.4f}"},
            "autoscaler": asdict(chosen),
            "checks": [c for c in model_checks if c["shape"] == shape],
            "row": row,
            "scenarios": {
                "burst2": slim(burst2),
                "burst4": slim(burst4),
                "burst4_empty_kernel_cache": slim(burst4_cold),
                "keda_from_zero": slim(zero),
            },
        }
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        plot(
            {"2x": burst2, "4x": burst4},
            f"{shape}: base {base:g} req/s, min {n} replicas, queue-time target {target:g} ms "
            f"(ready {scaler.schedule_s:g}+{scaler.ready_s:g} s)",
            out.with_suffix(".png"),
        )
    print(json.dumps(table, indent=1))


def one(args: argparse.Namespace) -> None:
    models, _ = measured_models(measured(args))
    target = args.target_ms if args.metric == "queue" else args.target_concurrency
    scaler = autoscaler(args, kind=args.kind, target=target, min_replicas=args.min_replicas)
    base = args.base_rps if args.base_rps else args.base[args.shape]
    res = simulate(models[args.shape], Traffic(base, burst=args.burst), scaler, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"autoscaler": asdict(scaler), **slim(res)}, indent=1) + "\n")
    plot({f"{args.burst:g}x": res}, f"{args.shape}: base {base:g} req/s", out.with_suffix(".png"))
    print(json.dumps(res.summary, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    inputs = parser.add_argument_group("the measurements (JSON files) the replicas are modelled on: Measured")
    inputs.add_argument("--bench", type=Path, required=True, help="python -m kev_backend.dev.bench (1/8/32/64 clients)")
    inputs.add_argument("--triton", type=Path, required=True, help="the same engine through Triton's gRPC door")
    inputs.add_argument("--openloop-short6", type=Path, required=True, help="loadtest/openloop.py, short6")
    inputs.add_argument("--openloop-mix", type=Path, required=True, help="loadtest/openloop.py, the mix")
    inputs.add_argument("--soak", type=Path, required=True, help="loadtest/soak.py")
    parser.add_argument("--shape", choices=("short6", "long5", "mix"), help="one scenario instead of the table")
    parser.add_argument("--shapes", default="short6,long5,mix", type=lambda s: s.split(","))
    parser.add_argument("--base", default="short6=500,long5=50,mix=200", help="base req/s per shape")
    parser.add_argument("--base-rps", type=float, default=0.0, help="with --shape: its base req/s")
    parser.add_argument("--burst", type=float, default=2.0, help="with --shape: the burst's multiple of base")
    parser.add_argument("--kind", choices=("hpa", "keda", "none"), default="hpa")
    parser.add_argument("--metric", choices=("queue", "concurrency"), default="queue")
    parser.add_argument("--target-ms", type=float, default=20.0, help="queue time per request (Triton's), ms")
    parser.add_argument("--target-concurrency", type=float, default=32.0, help="requests in flight per replica")
    parser.add_argument("--targets", default="5,10,20,40,80", type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--max-replicas", type=int, default=64)
    parser.add_argument("--schedule-s", type=float, default=20.0, help="pod scheduled to container started (assumed)")
    parser.add_argument("--ready-s", type=float, default=11.6, help="container start to ready (measured, kept cache)")
    parser.add_argument("--window-s", type=float, default=60.0, help="the metric's rate window")
    parser.add_argument("--lag-s", type=float, default=0.0, help="adapter and HPA staleness beyond the scrape")
    parser.add_argument("--down-window-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/sizing", help="writes OUT-<shape>.json and .png (the table)")
    args = parser.parse_args()
    args.base = {k: float(v) for k, v in (kv.split("=") for kv in args.base.split(","))}
    if args.shape:
        one(args)
    else:
        sizing(args)


def measured(args: argparse.Namespace) -> Measured:
    return Measured(args.bench, args.triton, args.openloop_short6, args.openloop_mix, args.soak)


if __name__ == "__main__":
    main()
