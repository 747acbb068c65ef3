"""Several Kev servers (one per GPU, each with its own state bank) behind the state-affinity router, measured against
one server behind the same router: throughput, the bank's hit rate with and without affinity, and a server lost
mid-run. `run` starts the servers (build/serve.sh without its gateway: on a GPU the GPU configuration, chosen by
itself) and the router (Envoy, configured by kev_backend.serve.router), measures, and stops them all.

    python loadtest/scaleout.py run --checkpoint DIR --servers 2 --out TWO.json      (server i on GPU i, if any)
    python loadtest/scaleout.py report --out RESULT.json ONE.json TWO.json           (the comparison, and a plot)

The phases of `run`, each a closed loop over gRPC through the router after a 2-s warm-up:
- throughput: short6 on new states at each of --clients (64 and 128).
- mix: the realistic mix (jevbench-240) at --mix-clients (64), a --repeat share (0.5) of its requests on a state
  already sent: with affinity (each request carries its state key, as kev_backend.serve.client sends it) and
  without (each request a random key, spread as requests without one are). Its hit rate: the share of requests
  whose state was not computed, from the servers' kev_bank_misses_total.
- failover (two servers or more): short6 with the --repeat share at --mix-clients; a third into the run the last
  server and everything it started are killed (SIGKILL: a GPU lost, nothing drained). Errors, when the last came,
  when the router took the server out, and requests/s by half-second.
Client load comes from --procs processes (one Python process tops out near 300 requests/s). Every run's requests
are its own: no state of one run (warm-ups included) is sent by another.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from loops import in_processes
from served import ready

from kev_backend.dev.ports import free_port
from kev_backend.dev.provenance import commit, gpu_name
from kev_backend.dev.workloads import Traffic
from kev_backend.serve.client import AsyncKevClient, KevError, prometheus
from kev_backend.serve.supervisor import procs

REPO = Path(__file__).resolve().parent.parent
ENVOY = Path(sys.prefix) / "bin" / "envoy"
# A half-second bucket of the failover timeline.
BUCKET_S = 0.5
# Seeds a measurement: its warm-up's client processes take the first half, its run's the second (so --procs is
# at most half of it); each client process numbers its new states from its seed x 10**7.
PHASE_SEEDS = 1000


@dataclasses.dataclass
class Server:
    """build/serve.sh (kev-serve: tritonserver without the gateway) on loopback ports, in a session of its own."""

    grpc_port: int
    http_port: int
    metrics_port: int
    process: subprocess.Popen
    gpu: str | None
    last_bank: dict[str, float] = dataclasses.field(default_factory=lambda: {"hits": 0.0, "misses": 0.0})

    @classmethod
    def start(cls, checkpoint: Path, log: Path, gpu: str | None) -> Server:
        ports = [free_port() for _ in range(3)]
        env = {
            **os.environ,
            "KEV_VENV": sys.prefix,
            "KEV_CHECKPOINT": str(checkpoint.resolve()),
            "HTTP_PORT": str(ports[0]),
            "GRPC_PORT": str(ports[1]),
            "METRICS_PORT": str(ports[2]),
            "GATEWAY": "0",
            # No inference probe: its requests would count in the bank's hits. A lost server is the router's
            # health check's to find.
            "KEV_PROBE_INTERVAL_S": "0",
        }
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        process = subprocess.Popen(
            [str(REPO / "build" / "serve.sh")],
            env=env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return cls(ports[1], ports[0], ports[2], process, gpu)

    @property
    def spec(self) -> str:
        return f"127.0.0.1:{self.grpc_port}/{self.http_port}"

    def ready(self) -> bool:
        """Triton answers ready; RuntimeError once the server has exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"exited with code {self.process.returncode}")
        return ready(f"127.0.0.1:{self.http_port}")

    def bank(self) -> dict[str, float]:
        """The bank's hits and misses so far; for a server that is gone, as last read (kill() reads them first)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
                samples = prometheus.parse(reply.read().decode())
        except OSError:
            return self.last_bank
        self.last_bank = {name: prometheus.total(samples, f"kev_bank_{name}_total") for name in ("hits", "misses")}
        return self.last_bank

    def kill(self) -> None:
        """SIGKILL to this server's processes and every one they started (tritonserver runs in a process group of
        its own under the supervisor, so one group is not enough)."""
        self.bank()
        for pid in [self.process.pid, *procs.descendants(self.process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


class Router:
    """Envoy in front of `servers`, as kev_backend.serve.router configures it."""

    def __init__(self, servers: list[Server], work: Path) -> None:
        self.port, self.admin = free_port(), free_port()
        config = work / "envoy.json"
        specs = [f"--server={server.spec}" for server in servers]
        subprocess.run(
            [sys.executable, "-m", "kev_backend.serve.router", f"--listen=127.0.0.1:{self.port}", *specs,
             f"--admin=127.0.0.1:{self.admin}", f"--out={config}"],
            check=True,
        )  # fmt: skip
        self.process = subprocess.Popen(
            [str(ENVOY), "-c", str(config), "--base-id", str(self.port), "-l", "warning"],
            stdout=(work / "envoy.log").open("wb"),
            stderr=subprocess.STDOUT,
        )

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def healthy(self) -> int:
        """Servers Envoy counts healthy."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/clusters", timeout=2) as reply:
                lines = reply.read().decode().splitlines()
        except OSError:
            return 0
        return sum(1 for line in lines if line.startswith("kev-triton::") and line.endswith("::health_flags::healthy"))

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=10)


def wait_for(check, what: str, timeout_s: float) -> float:
    """Seconds until check() holds; RuntimeError naming `what` past `timeout_s` or when check() raises one."""
    started = time.monotonic()
    try:
        while not check():
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"not within {timeout_s:.0f} s")
            time.sleep(0.2)
    except RuntimeError as error:
        raise RuntimeError(f"{what}: {error}") from None
    return time.monotonic() - started


# The client side: --procs processes, each an asyncio loop of closed-loop clients on one gRPC channel.


@dataclasses.dataclass(frozen=True)
class Load:
    shape: str
    repeat: float
    affinity: bool
    clients: int
    seconds: float


async def _clients(url: str, load: Load, seed: int, start_at: float) -> list[tuple[float, float, bool, bool, str]]:
    """This process's share of a closed loop: (sent, answered, ok, repeated state, error kind) a request, times
    in seconds from `start_at` (the wall clock every process shares)."""
    traffic = Traffic(load.shape, load.repeat, seed=seed, numbered_from=seed * 10**7)  # each stream's own states
    sent_states: set[int] = set()  # ids of the bodies sent (Traffic repeats a state by sending its body again)
    records: list[tuple[float, float, bool, bool, str]] = []
    await asyncio.sleep(max(0.0, start_at - time.time()))
    deadline = start_at + load.seconds
    async with AsyncKevClient(url, timeout_s=120.0) as kev:

        async def client() -> None:
            while time.time() < deadline:
                body = traffic.next()
                repeated = id(body) in sent_states
                sent_states.add(id(body))
                key = None if load.affinity else secrets.token_hex(8)
                sent = time.time() - start_at
                try:
                    await kev.score_raw(json.dumps(body), state_key=key)
                    ok, error = True, ""
                except KevError as failure:
                    ok, error = False, failure.kind
                records.append((sent, time.time() - start_at, ok, repeated, error))

        await asyncio.gather(*(client() for _ in range(load.clients)))
    return records


def _process(
    clients: int, seed: int, start_at: float, url: str, load: Load
) -> list[tuple[float, float, bool, bool, str]]:
    return asyncio.run(_clients(url, dataclasses.replace(load, clients=clients), seed, start_at))


def closed_loop(url: str, load: Load, procs: int, seed: int, during=None) -> list[tuple]:
    """`load` spread over `procs` processes, all starting together; `during` (at, fn): fn() called `at` seconds into
    the run, from this process. Every request's record."""
    runs = in_processes(_process, load.clients, procs, seed, url, load, during=during)
    return [record for records in runs for record in records]


def summary(records: list[tuple], seconds: float) -> dict[str, Any]:
    """requests/s answered within the run's `seconds` (the last requests finish after it), p50/p99 of every answered
    one, errors by kind."""
    latencies = sorted(done - sent for sent, done, ok, _, _ in records if ok)
    within = sum(1 for _, done, ok, _, _ in records if ok and done <= seconds)
    errors: dict[str, int] = {}
    for *_, ok, _, error in records:
        if not ok:
            errors[error] = errors.get(error, 0) + 1
    return {
        "rps": within / seconds,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
        "requests": len(records),
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
    }


def bank_totals(servers: list[Server]) -> dict[str, float]:
    banks = [server.bank() for server in servers]
    return {name: sum(bank[name] for bank in banks) for name in ("hits", "misses")}


def measured(url: str, load: Load, procs: int, phase: int, servers: list[Server], during=None) -> dict[str, Any]:
    """A 2-s warm-up of `load`, then `load` itself: its summary, the repeated states it sent and what the servers'
    banks counted over the run. hit_rate: the share of requests whose state was not computed (found in a bank, or
    computed once for several requests in one batch): 1 - kev_bank_misses_total / requests. repeats_answered: the
    same requests over the repeated ones (only a repeat can find its state), which does not move with the share of
    repeats a run happens to send. bank_hit_rate: the banks' own hits / (hits + misses), where a state shared within a
    batch counts once. `phase`: a number of the measurement's own (its seeds, hence its states)."""
    closed_loop(url, Load(load.shape, load.repeat, load.affinity, load.clients, 2.0), procs, PHASE_SEEDS * phase)
    before = bank_totals(servers)
    records = closed_loop(url, load, procs, PHASE_SEEDS * phase + PHASE_SEEDS // 2, during)
    after = bank_totals(servers)
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    repeats = sum(1 for *_, repeated, _ in records if repeated)
    result = summary(records, load.seconds) | {
        "repeated_states": repeats,
        "bank_hits": hits,
        "bank_misses": misses,
        "hit_rate": max(0.0, 1 - misses / len(records)) if records else None,
        "repeats_answered": min(1.0, max(0.0, (len(records) - misses) / repeats)) if repeats else None,
        "bank_hit_rate": hits / (hits + misses) if hits + misses else None,
    }
    return result | {"records": records} if during is not None else result


def failover(url: str, args: argparse.Namespace, servers: list[Server], router: Router) -> dict[str, Any]:
    """short6 with the repeat share at --mix-clients; the last server killed a third into the run."""
    victim = servers[-1]
    kill_at = args.seconds / 3
    ejected: list[float] = []
    watchers: list[threading.Thread] = []

    def watch(killed: float) -> None:
        """Seconds from the kill until Envoy's health check has taken the server out (none past 30 s)."""
        while router.healthy() != len(servers) - 1:
            if time.monotonic() - killed > 30:
                return
            time.sleep(0.05)
        ejected.append(time.monotonic() - killed)

    def kill() -> None:
        killed = time.monotonic()
        victim.kill()
        watchers.append(threading.Thread(target=watch, args=(killed,), daemon=True))
        watchers[0].start()

    load = Load("short6", args.repeat, True, args.mix_clients, args.seconds)
    result = measured(url, load, args.procs, 20, servers, during=(kill_at, kill))
    for watcher in watchers:
        watcher.join(timeout=35)
    records = result.pop("records")
    buckets = int(args.seconds / BUCKET_S) + 1
    answered, failed = [0] * buckets, [0] * buckets
    for _, done, ok, _, _ in records:
        slot = min(buckets - 1, int(done / BUCKET_S))
        (answered if ok else failed)[slot] += 1
    errors = sorted(done for _, done, ok, _, _ in records if not ok)
    after = [record for record in records if record[1] >= kill_at]
    return result | {
        "killed_at_s": round(kill_at, 2),
        "killed_server": len(servers) - 1,
        "answered_before_kill": sum(1 for _, done, ok, _, _ in records if ok and done < kill_at),
        "answered_after_kill": sum(1 for _, _, ok, _, _ in after if ok),
        "errors_after_kill": sum(1 for _, _, ok, _, _ in after if not ok),
        "last_error_after_kill_s": round(errors[-1] - kill_at, 2) if errors else None,
        "router_ejected_after_s": round(ejected[0], 2) if ejected else None,
        "timeline": {"bucket_s": BUCKET_S, "answered": answered, "errors": failed},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    gpus = args.gpus if args.gpus is not None else [None] * args.servers
    if len(gpus) != args.servers:
        raise SystemExit(f"--gpus names {len(gpus)} GPUs for {args.servers} servers")
    work = Path(tempfile.mkdtemp(prefix="kev-scaleout-"))
    started = time.monotonic()
    servers = [Server.start(args.checkpoint, work / f"server{i}.log", gpu) for i, gpu in enumerate(gpus)]
    router = None
    try:
        for i, server in enumerate(servers):
            wait_for(server.ready, f"server {i} (log {work}/server{i}.log)", args.start_timeout)
        ready_s = time.monotonic() - started
        router = Router(servers, work)
        wait_for(lambda: router.healthy() == len(servers), f"the router (log {work}/envoy.log)", 60)
        result: dict[str, Any] = {
            "servers": len(servers),
            "gpus": [gpu for gpu in gpus if gpu is not None],
            "gpu": gpu_name(),
            "date": time.strftime("%Y-%m-%d"),
            "commit": commit(args.commit),
            "ready_s": round(ready_s, 1),
            "seconds": args.seconds,
            "procs": args.procs,
            "repeat": args.repeat,
            "throughput": {},
        }
        for phase, clients in enumerate(args.clients, 1):
            load = Load("short6", 0.0, True, clients, args.seconds)
            result["throughput"][str(clients)] = measured(router.url, load, args.procs, phase, servers)
            print(f"{len(servers)} servers, short6 at {clients} clients: {brief(result['throughput'][str(clients)])}")
        result["mix"] = {}
        for phase, (name, affinity) in enumerate((("affinity", True), ("no_affinity", False)), 10):
            load = Load("mix", args.repeat, affinity, args.mix_clients, args.seconds)
            result["mix"][name] = measured(router.url, load, args.procs, phase, servers)
            print(f"{len(servers)} servers, mix {name}: {brief(result['mix'][name])}")
        if len(servers) > 1:
            result["failover"] = failover(router.url, args, servers, router)
            print(f"{len(servers)} servers, failover: {brief(result['failover'])}")
        return result
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()


def brief(figures: dict[str, Any]) -> str:
    keys = ("rps", "p50_ms", "errors", "hit_rate", "errors_after_kill", "last_error_after_kill_s")
    return ", ".join(f"{k} {figures[k]:.3g}" if isinstance(figures[k], float) else f"{k} {figures[k]}"
                     for k in keys if k in figures)  # fmt: skip


def report(one: dict[str, Any], many: dict[str, Any] | None) -> dict[str, Any]:
    """The results file: one server's run as the baseline and, where there is one, the run on several GPUs.
    speedup: several over one on short6's new states at the client count where several do best; p50_ratio: their
    p50 at that count over one server's at the count that loads one GPU alike (clients per server)."""
    result: dict[str, Any] = {
        "gpu": one["gpu"],
        "date": one["date"],
        "commit": one["commit"],
        "gpus": many["servers"] if many else 1,
        "hit_rate_one_gpu": one["mix"]["affinity"]["hit_rate"],
        "one_gpu": one,
    }
    if many is None:
        return result
    best = max(many["throughput"], key=lambda c: many["throughput"][c]["rps"])
    alike = str(int(best) // many["servers"])
    base = one["throughput"].get(alike) or one["throughput"][best]
    return result | {
        "speedup": many["throughput"][best]["rps"] / one["throughput"][best]["rps"],
        "speedup_clients": int(best),
        "p50_ratio": many["throughput"][best]["p50_ms"] / base["p50_ms"],
        "hit_rate_affinity": many["mix"]["affinity"]["hit_rate"],
        "hit_rate_no_affinity": many["mix"]["no_affinity"]["hit_rate"],
        "repeats_answered_one_gpu": one["mix"]["affinity"]["repeats_answered"],
        "repeats_answered_affinity": many["mix"]["affinity"]["repeats_answered"],
        "repeats_answered_no_affinity": many["mix"]["no_affinity"]["repeats_answered"],
        "several_gpus": many,
    }


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("1 server", record["one_gpu"])]
    if "several_gpus" in record:
        runs.append((f"{record['gpus']} servers", record["several_gpus"]))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    clients = sorted({c for _, run in runs for c in run["throughput"]}, key=int)
    width = 0.8 / len(runs)
    for i, (label, run) in enumerate(runs):
        xs = [j + i * width for j in range(len(clients))]
        axes[0].bar(xs, [run["throughput"].get(c, {}).get("rps", 0) for c in clients], width, label=label)
        rates = [run["mix"][k]["hit_rate"] or 0 for k in ("affinity", "no_affinity")]
        axes[1].bar([j + i * width for j in range(2)], rates, width, label=label)
    axes[0].set_xticks(
        [j + width * (len(runs) - 1) / 2 for j in range(len(clients))], [f"{c} clients" for c in clients]
    )
    axes[0].set_ylabel("short6 requests/s (new states)")
    axes[1].set_xticks([width * (len(runs) - 1) / 2, 1 + width * (len(runs) - 1) / 2], ["affinity", "no affinity"])
    axes[1].set_ylabel(f"state bank hit rate (mix, repeat {record['one_gpu']['repeat']})")
    for ax in axes[:2]:
        ax.legend()
        ax.grid(True, axis="y", alpha=0.3)
    if "several_gpus" in record and "failover" in record["several_gpus"]:
        over = record["several_gpus"]["failover"]
        step = over["timeline"]["bucket_s"]
        times = [i * step for i in range(len(over["timeline"]["answered"]))]
        axes[2].plot(times, [n / step for n in over["timeline"]["answered"]], label="answered/s")
        axes[2].plot(times, [n / step for n in over["timeline"]["errors"]], label="errors/s")
        axes[2].axvline(over["killed_at_s"], color="k", linestyle=":", label="server killed")
        axes[2].set_xlabel("seconds into the run")
        axes[2].legend()
        axes[2].grid(True, alpha=0.3)
    else:
        axes[2].set_axis_off()
    fig.suptitle(f"Kev on Triton, {record['gpu']}: one server per GPU behind the state-affinity router")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="start the servers and the router, measure, stop")
    run_parser.add_argument("--checkpoint", type=Path, required=True)
    run_parser.add_argument("--servers", type=int, default=1)
    run_parser.add_argument("--gpus", type=lambda s: s.split(","), help="GPU of each server (default: 0, 1, ... on "
                            "a GPU machine; none on a CPU one)")  # fmt: skip
    run_parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[64, 128])
    run_parser.add_argument("--mix-clients", type=int, default=64, help="clients of the mix and the failover (64)")
    run_parser.add_argument("--seconds", type=float, default=10.0, help="each measured run (default 10)")
    run_parser.add_argument("--repeat", type=float, default=0.5)
    run_parser.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    run_parser.add_argument("--start-timeout", type=float, default=600.0)
    run_parser.add_argument("--commit")
    run_parser.add_argument("--out", type=Path, required=True)
    report_parser = sub.add_parser("report", help="the results file from one server's run and several's")
    report_parser.add_argument("--out", type=Path, required=True)
    report_parser.add_argument("runs", type=Path, nargs="+", help="ONE.json [SEVERAL.json]")
    args = parser.parse_args()
    # SIGTERM (a timeout) ends the run as an exception does: the servers and the router are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.command == "run":
        if not 0 < args.procs <= PHASE_SEEDS // 2:
            parser.error(f"--procs must be 1 to {PHASE_SEEDS // 2}")
        if args.gpus is None and gpu_name() != "cpu":
            args.gpus = [str(i) for i in range(args.servers)]
        record = run(args)
    else:
        runs = [json.loads(path.read_text()) for path in args.runs]
        record = report(runs[0], runs[1] if len(runs) > 1 else None)
        plot(record, args.out.with_suffix(".png"))
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
