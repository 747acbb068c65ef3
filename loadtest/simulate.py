"""The simulator of a Kev on Triton deployment under traffic and an autoscaler, driven by a replica's service curves.

N replicas (one GPU each) behind a router that spreads new states at random (MAGLEV on a fresh state key). Each
replica is a batching server: with n requests in it, it serves the request at the head of its FIFO queue at the rate
its measured requests/s at concurrency n gives (interpolated between the bench's 1 / 8 / 32 / 64 clients, flat past
64, Triton's max batch). A request's replica time at concurrency n is `(1 - a) / X_short6(n) + a / X_long5(n) + host`
(a = 0 for short6, 1 for long5, the request's place between the two by length for the jevbench mix), plus a
front-door latency that uses no capacity. Past 576 requests in a replica (Triton's queue of 512 behind a batch of 64)
an arrival is refused, and so is a request that waited 30 s. New replicas are ready `schedule_s + ready_s` after the
autoscaler asks for them. The autoscaler is Kubernetes' HPA on a per-pod metric (Triton's queue time per request,
over a rate window of Prometheus scrapes, or requests in flight per replica): every `sync_s`,
desired = ceil(current x metric / target) outside a 10 % tolerance, pods without a metric counted as 0 when scaling
up and as the target when scaling down, scale-up limited by its policies, scale-down by its stabilization window.
KEDA adds scale from zero: one replica is asked for at the first poll that sees traffic.

The sizing from measured curves and its command line are loadtest/sizing.py.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SHORT6_TOKENS, LONG5_TOKENS = 218, 2630


# --------------------------------------------------------------------------------------------------- the replica model
@dataclass(frozen=True)
class ServiceModel:
    """One replica's service: requests/s at each concurrency for the two measured classes (short6-like, long5-like),
    Triton's host cost per request (capacity), the front door's latency (none of the capacity), the share of a
    request's wait that Triton counts as queue time, the queue bound and timeout, and the population of `a` (the place
    of a request between the two classes) that requests are drawn from."""

    concurrency: tuple[float, ...]
    short_rps: tuple[float, ...]
    long_rps: tuple[float, ...]
    host_s: float = 0.0
    door_s: float = 0.0
    queue_share: float = 1.0
    max_in_system: int = 576
    timeout_s: float = 30.0
    mix: tuple[float, ...] = (0.0,)
    conc_scale: float = 1.0  # requests in the server at a closed loop of c clients: 1 + conc_scale x (c - 1)
    cost_scale: tuple[float, float] = (1.0, 1.0)  # cost multiplier at n = 1 and n >= 64 (log-linear between)

    def cost_arrays(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        conc = 1.0 + (np.asarray(self.concurrency) - 1.0) * self.conc_scale
        top = conc[-1]
        w = np.clip(np.log(np.maximum(n, 1.0)) / math.log(max(top, 1.0 + 1e-9)), 0.0, 1.0)
        scale = self.cost_scale[0] ** (1 - w) * self.cost_scale[1] ** w
        short = (1.0 / np.interp(n, conc, self.short_rps) + self.host_s) * scale
        long = (1.0 / np.interp(n, conc, self.long_rps) + self.host_s) * scale
        return short, long

    def costs(self) -> tuple[list[float], list[float]]:
        """Replica seconds a request of each class takes at concurrency n = 0 .. max_in_system (index n)."""
        n = np.arange(self.max_in_system + 2, dtype=float)
        n[0] = 1.0
        short, long = self.cost_arrays(n)
        return short.tolist(), long.tolist()

    def capacity(self, concurrency: float | None = None) -> float:
        """Requests/s of one replica at a concurrency (past the largest measured one by default), mean request."""
        c = 2 * self.concurrency[-1] if concurrency is None else concurrency
        a = float(np.mean(self.mix))
        short, long = self.cost_arrays(np.array([float(c)]))
        return 1.0 / float((1 - a) * short[0] + a * long[0])


class Replica:
    """A FIFO batching server with a concurrency-dependent rate, advanced lazily to a time."""

    __slots__ = ("queue", "head_left", "clock", "ready_at", "queue_sum", "done", "scrapes", "born")

    def __init__(self, ready_at: float, born: float) -> None:
        self.queue: deque[tuple[float, float]] = deque()  # (arrival time, a)
        self.head_left = 1.0  # share of the head request's work still to do
        self.clock = ready_at
        self.ready_at = ready_at
        self.born = born
        self.queue_sum = 0.0  # Triton's nv_inference_queue_duration (s), cumulative
        self.done = 0  # nv_inference_request_success, cumulative
        self.scrapes: list[tuple[float, float, int, int]] = []  # (time, queue_sum, done, in system)


@dataclass
class Recorder:
    done_t: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    refused_t: list[float] = field(default_factory=list)


class Server:
    """Advances replicas: completions, timeouts, Triton's counters."""

    def __init__(self, model: ServiceModel, record: Recorder) -> None:
        self.model = model
        self.short, self.long = model.costs()
        self.record = record

    def advance(self, r: Replica, t: float) -> None:
        q, short, long, timeout = r.queue, self.short, self.long, self.model.timeout_s
        clock, left = r.clock, r.head_left
        done_t, latency, refused_t = self.record.done_t, self.record.latency, self.record.refused_t
        door, share = self.model.door_s, self.model.queue_share
        while q:
            n = len(q)
            arrival, a = q[0]
            if left == 1.0 and clock - arrival > timeout:  # timed out in the queue: refused at arrival + timeout
                q.popleft()
                refused_t.append(arrival + timeout)
                continue
            cost = (1.0 - a) * short[n] + a * long[n]
            end = clock + left * cost
            if end > t:
                left -= (t - clock) / cost
                clock = t
                break
            q.popleft()
            clock, left = end, 1.0
            total = end - arrival
            alone = (1.0 - a) * short[1] + a * long[1]
            r.queue_sum += share * max(0.0, total - alone)
            r.done += 1
            done_t.append(end)
            latency.append(total + door)
        else:
            clock = max(clock, t)
        r.clock, r.head_left = clock, left

    def arrive(self, r: Replica, t: float, a: float) -> None:
        self.advance(r, t)
        if len(r.queue) >= self.model.max_in_system:
            self.record.refused_t.append(t)
            return
        if not r.queue:
            r.clock, r.head_left = t, 1.0
        r.queue.append((t, a))


# ------------------------------------------------------------------------------------------------ traffic and scaling
@dataclass(frozen=True)
class Traffic:
    """Poisson arrivals: `base` requests/s, `burst` x base from `burst_at` for `burst_s`; nothing before `start_at`."""

    base: float
    burst: float = 1.0
    burst_at: float = 300.0
    burst_s: float = 300.0
    duration: float = 900.0
    start_at: float = 0.0

    def arrivals(self, rng: np.random.Generator) -> np.ndarray:
        cuts = (self.start_at, self.burst_at, self.burst_at + self.burst_s, self.duration)
        edges = sorted({min(max(e, self.start_at), self.duration) for e in cuts})
        times = []
        for lo, hi in zip(edges, edges[1:]):
            if hi <= lo or lo < self.start_at:
                continue
            rate = self.base * (self.burst if self.burst_at <= lo < self.burst_at + self.burst_s else 1.0)
            count = rng.poisson(rate * (hi - lo))
            times.append(np.sort(rng.uniform(lo, hi, count)))
        return np.concatenate(times) if times else np.zeros(0)

    def rate_at(self, t: float) -> float:
        if t < self.start_at:
            return 0.0
        return self.base * (self.burst if self.burst_at <= t < self.burst_at + self.burst_s else 1.0)


@dataclass(frozen=True)
class Autoscaler:
    """Kubernetes' HPA (kind "hpa"), KEDA in front of it (kind "keda": scale from and to zero), or fixed ("none").
    metric "queue": Triton's queue time per request in ms, averaged over `window_s` of scrapes (the prometheus-adapter
    rule of deploy/); "concurrency": requests in a replica, averaged over the scrapes of the window."""

    kind: str = "hpa"
    metric: str = "queue"
    target: float = 20.0
    min_replicas: int = 1
    max_replicas: int = 64
    sync_s: float = 15.0
    scrape_s: float = 15.0
    window_s: float = 60.0
    lag_s: float = 0.0
    tolerance: float = 0.1
    up_percent: float = 100.0
    up_pods: int = 4
    up_period_s: float = 15.0
    down_window_s: float = 300.0
    schedule_s: float = 20.0
    ready_s: float = 11.6


@dataclass
class Result:
    windows: list[dict[str, Any]]
    scaling: list[dict[str, Any]]
    summary: dict[str, Any]


def pod_metric(r: Replica, scaler: Autoscaler, now: float) -> float | None:
    """The pod's metric as the HPA reads it at `now`, or None while it has too few scrapes for a rate."""
    seen = [s for s in r.scrapes if s[0] <= now - scaler.lag_s]
    if len(seen) < 2:
        return None
    last = seen[-1]
    first = next((s for s in seen if s[0] >= last[0] - scaler.window_s - 1e-9), seen[0])
    if first is last:
        first = seen[-2]
    if scaler.metric == "concurrency":
        inside = [s[3] for s in seen if s[0] > last[0] - scaler.window_s - 1e-9]
        return float(np.mean(inside))
    answered = last[2] - first[2]
    return 1000.0 * (last[1] - first[1]) / answered if answered > 0 else 0.0


def simulate(
    model: ServiceModel, traffic: Traffic, scaler: Autoscaler, seed: int = 0, window_s: float = 10.0
) -> Result:
    """One scenario: replicas start at min_replicas, ready at t = 0 (KEDA with min 0: none)."""
    rng = np.random.default_rng(seed)
    times = traffic.arrivals(rng)
    mix = np.asarray(model.mix, dtype=float)
    shares = mix[rng.integers(0, len(mix), len(times))] if len(mix) > 1 else np.full(len(times), mix[0])
    route = rng.random(len(times))
    record = Recorder()
    server = Server(model, record)
    replicas: list[Replica] = [Replica(0.0, 0.0) for _ in range(scaler.min_replicas)]
    ready: list[Replica] = list(replicas)
    pending: list[tuple[float, int, Replica]] = []  # (ready time, order, replica)
    order = 0
    recommendations: deque[tuple[float, int]] = deque()
    history: list[tuple[float, int]] = [(0.0, len(replicas))]
    scaling: list[dict[str, Any]] = []
    seen_traffic = False
    next_scrape, next_sync = scaler.scrape_s, scaler.sync_s
    arrivals = times.tolist()
    a_list = shares.tolist()
    route_list = route.tolist()
    i = 0

    def scrape(now: float) -> None:
        for r in ready:
            server.advance(r, now)
            r.scrapes.append((now, r.queue_sum, r.done, len(r.queue)))
            if len(r.scrapes) > 64:
                del r.scrapes[:16]

    def count_at(t: float) -> int:
        k = bisect.bisect_right([h[0] for h in history], t) - 1
        return history[max(0, k)][1]

    def sync(now: float) -> None:
        nonlocal order
        current = len(replicas)
        values = [pod_metric(r, scaler, now) if r.ready_at <= now else None for r in replicas]
        desired = current
        if scaler.kind == "none":
            pass
        elif current == 0:
            desired = 1 if (scaler.kind == "keda" and seen_traffic) else 0
        else:
            known = [v for v in values if v is not None]
            if known:
                ratio = sum(known) / len(known) / scaler.target
                if abs(ratio - 1.0) > scaler.tolerance:
                    # Kubernetes' rule for pods without a metric: 0 when scaling up, the target when scaling down;
                    # no change if that flips the direction or lands within the tolerance.
                    missing = len(values) - len(known)
                    fixed = (sum(known) / scaler.target + (0 if ratio > 1 else missing)) / len(values)
                    if (fixed - 1.0) * (ratio - 1.0) > 0 and abs(fixed - 1.0) > scaler.tolerance:
                        desired = math.ceil(current * fixed - 1e-9)
        floor = max(scaler.min_replicas, 1 if current > 0 else 0)  # KEDA hands 1..max to an HPA once active
        desired = min(scaler.max_replicas, max(floor, desired))
        recommendations.append((now, desired))
        while recommendations and recommendations[0][0] < now - scaler.down_window_s:
            recommendations.popleft()
        if desired < current:
            desired = min(current, max(d for _, d in recommendations))
        if desired > current:
            base = count_at(now - scaler.up_period_s)
            limit = max(math.ceil(base * (1 + scaler.up_percent / 100)), base + scaler.up_pods)
            desired = max(current, min(desired, limit))
        if desired > current:
            for _ in range(desired - current):
                r = Replica(now + scaler.schedule_s + scaler.ready_s, now)
                replicas.append(r)
                order += 1
                heapq.heappush(pending, (r.ready_at, order, r))
        elif desired < current:
            for _ in range(current - desired):
                r = max(replicas, key=lambda x: (x.ready_at > now, x.born))  # not-ready pods first, then the newest
                replicas.remove(r)
                if r in ready:
                    ready.remove(r)
                    server.advance(r, math.inf)  # drains: no more arrivals, so its remaining work is known now
        if desired != current:
            history.append((now, len(replicas)))
        known = [v for v in values if v is not None]
        scaling.append(
            {
                "t_s": now,
                "replicas": len(replicas),
                "ready": sum(1 for r in replicas if r.ready_at <= now),
                "metric": round(float(np.mean(known)), 3) if known else None,
            }
        )

    end = traffic.duration
    while True:
        t_arrival = arrivals[i] if i < len(arrivals) else end
        t_ready = pending[0][0] if pending else math.inf
        t_next = min(t_arrival, next_scrape, next_sync, t_ready)
        if t_next >= end and i >= len(arrivals):
            break
        if t_next == t_ready:
            _, _, r = heapq.heappop(pending)
            if r in replicas:
                ready.append(r)
        elif t_next == next_scrape:
            scrape(next_scrape)
            next_scrape += scaler.scrape_s
        elif t_next == next_sync:
            sync(next_sync)
            seen_traffic = False
            next_sync += scaler.sync_s
        else:
            seen_traffic = True
            if ready:
                server.arrive(ready[int(route_list[i] * len(ready))], t_arrival, a_list[i])
            else:
                record.refused_t.append(t_arrival)  # no ready replica: the router answers 503
            i += 1
    for r in replicas:
        server.advance(r, math.inf)
    return summarize(record, traffic, scaling, scaler, window_s, len(times))


def summarize(
    record: Recorder, traffic: Traffic, scaling: list[dict[str, Any]], scaler: Autoscaler, window_s: float, sent: int
) -> Result:
    done_t = np.asarray(record.done_t)
    latency = np.asarray(record.latency) * 1000.0
    refused_t = np.asarray(record.refused_t)
    edges = np.arange(0.0, traffic.duration + window_s, window_s)
    slot = np.digitize(done_t, edges) - 1
    refused_slot = np.digitize(refused_t, edges) - 1
    sync_t = np.asarray([s["t_s"] for s in scaling]) if scaling else np.zeros(0)
    windows = []
    for k in range(len(edges) - 1):
        lat = latency[slot == k]
        j = int(np.searchsorted(sync_t, edges[k + 1], side="right")) - 1
        windows.append(
            {
                "t_s": float(edges[k]),
                "offered_rps": traffic.rate_at(float(edges[k])),
                "answered": int(len(lat)),
                "refused": int(np.sum(refused_slot == k)),
                "p50_ms": round(float(np.percentile(lat, 50)), 2) if len(lat) else None,
                "p99_ms": round(float(np.percentile(lat, 99)), 2) if len(lat) else None,
                "replicas": scaling[j]["replicas"] if j >= 0 else scaler.min_replicas,
                "ready": scaling[j]["ready"] if j >= 0 else scaler.min_replicas,
            }
        )
    p99 = [w["p99_ms"] for w in windows if w["p99_ms"] is not None]
    # seconds of 10 s windows whose p99 over all requests is past 500 ms: answered p99 > 500 ms, or > 1 % refused
    above = sum(
        window_s
        for w in windows
        if (w["p99_ms"] or 0.0) > 500.0 or w["refused"] > 0.01 * max(1, w["answered"] + w["refused"])
    )
    first_answer = float(done_t.min()) if len(done_t) else None
    summary = {
        "sent": sent,
        "answered": int(len(latency)),
        "refused": int(len(refused_t)),
        "refused_share": round(len(refused_t) / sent, 5) if sent else 0.0,
        "p99_ms": round(float(np.percentile(latency, 99)), 2) if len(latency) else None,
        "p99_peak_ms": max(p99) if p99 else None,
        "seconds_above_500ms": above,
        "max_replicas": max([s["replicas"] for s in scaling], default=scaler.min_replicas),
        "replica_seconds": round(sum(s["replicas"] for s in scaling) * scaler.sync_s, 1),
        "first_answer_s": round(first_answer, 2) if first_answer is not None else None,
    }
    return Result(windows, scaling, summary)
