"""Envoy in front of several Triton servers (one per GPU, each with its own state bank), routing every request to the
server whose bank may hold its state: MAGLEV consistent hashing on the state key header (x-kev-state-key, sent by
kev_backend.serve.client and the gateway), bounded load so one hot state cannot swamp its server, and active health
checks so a dead server's keys move to the others within about two seconds (only its keys move: MAGLEV).

    python -m kev_backend.serve.router --listen 127.0.0.1:8010 --server 127.0.0.1:8101/8100 \\
        --server 127.0.0.1:8201/8200 --out envoy.json          # N servers on one host (gRPC port / HTTP port)
    python -m kev_backend.serve.router --listen 0.0.0.0:8001 --dns kev-triton.kev.svc.cluster.local:8001/8000 \\
        --admin 127.0.0.1:9901 --ops 0.0.0.0:9902 --out deploy/base/envoy.yaml    # pods behind a headless Service
    envoy --mode validate -c envoy.json && envoy -c envoy.json

The router speaks gRPC (HTTP/2) to clients and servers alike: Triton's gRPC port carries inference, its HTTP port
only the health check (GET /v2/health/ready). A request the chosen server refuses at connection level is retried
on another server only when no byte of it reached the first, so a request is never scored twice. Requests without
the header are spread at random. deploy/base/envoy.yaml is this module's output (tests/serve/test_router.py checks it).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protocol.request import STATE_KEY_HEADER

CLUSTER = "kev-triton"
ADMIN_CLUSTER = "envoy-admin"
# Bounded load (Envoy's hash_balance_factor, in percent): no server takes more than 1.5x the mean of requests in
# flight; a hot state spills over to the next server in the table instead of queueing behind itself.
BALANCE_FACTOR = 150
HTTP_CONNECTION_MANAGER = "envoy.filters.network.http_connection_manager"
# Triton refuses past 30 s in its queue and the gateway gives up after 120 s (KEV_GATEWAY_TIMEOUT_S); a client's own
# grpc-timeout, when shorter, wins.
TIMEOUT = "130s"
ROUTER = "envoy.extensions.filters.http.router.v3.Router"
# HTTP/2 flow-control windows, Envoy's own advice for a proxy facing clients (its defaults are 256 MiB each): a peer
# may send 64 KiB a stream and 1 MiB a connection ahead of what Envoy has passed on, so the memory one client can
# make the router hold is bounded; a 4 MiB request still flows, a window at a time.
HTTP2_WINDOWS = {"initial_stream_window_size": 65536, "initial_connection_window_size": 1048576}


@dataclass(frozen=True)
class Server:
    host: str
    grpc_port: int
    http_port: int

    @classmethod
    def parse(cls, spec: str) -> Server:
        """HOST:GRPC_PORT/HTTP_PORT"""
        address, _, http = spec.partition("/")
        host, _, grpc = address.rpartition(":")
        if not host or not grpc.isdigit() or not http.isdigit():
            raise argparse.ArgumentTypeError(f"{spec!r} is not HOST:GRPC_PORT/HTTP_PORT")
        return cls(host, int(grpc), int(http))


def typed(kind: str, **fields: Any) -> dict[str, Any]:
    return {"@type": f"type.googleapis.com/{kind}", **fields}


def socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def listener(name: str, address: tuple[str, int], routes: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    manager = typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix=name,
        route_config={"name": name, "virtual_hosts": [{"name": name, "domains": ["*"], "routes": routes}]},
        http_filters=[
            {
                "name": "envoy.filters.http.router",
                "typed_config": typed("envoy.extensions.filters.http.router.v3.Router"),
            }
        ],
        **options,
    )
    filters = [{"name": HTTP_CONNECTION_MANAGER, "typed_config": manager}]
    return {"name": name, "address": socket(*address), "filter_chains": [{"filters": filters}]}


def inference_route() -> dict[str, Any]:
    return {
        "match": {"prefix": "/"},
        "route": {
            "cluster": CLUSTER,
            "timeout": TIMEOUT,
            "max_stream_duration": {"grpc_timeout_header_max": TIMEOUT},
            "hash_policy": [{"header": {"header_name": STATE_KEY_HEADER}}],
            # Only failures before any byte reached a server are retried, on another one: a request is never
            # scored twice.
            "retry_policy": {
                "retry_on": "connect-failure,refused-stream,reset-before-request",
                "num_retries": 2,
                "retry_host_predicate": [
                    {
                        "name": "envoy.retry_host_predicates.previous_hosts",
                        "typed_config": typed("envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"),
                    }
                ],
                "host_selection_retry_max_attempts": 3,
            },
        },
    }


def triton_cluster(servers: list[Server], dns: bool) -> dict[str, Any]:
    endpoints = [
        # Health checks go to each server's HTTP port, traffic to its gRPC port.
        {"endpoint": {"address": socket(s.host, s.grpc_port), "health_check_config": {"port_value": s.http_port}}}
        for s in servers
    ]
    cluster: dict[str, Any] = {"name": CLUSTER}
    if dns:  # every address the name resolves to is a server: a headless Service lists only Ready pods
        cluster["cluster_type"] = {
            "name": "envoy.cluster.dns",
            "typed_config": typed(
                "envoy.extensions.clusters.dns.v3.DnsCluster",
                all_addresses_in_single_endpoint=False,
                dns_lookup_family="V4_ONLY",
                dns_refresh_rate="5s",
                respect_dns_ttl=False,
            ),
        }
    else:
        cluster["type"] = "STATIC"
    maglev = {
        "name": "envoy.load_balancing_policies.maglev",
        "typed_config": typed(
            "envoy.extensions.load_balancing_policies.maglev.v3.Maglev",
            table_size=65537,
            consistent_hashing_lb_config={"hash_balance_factor": BALANCE_FACTOR},
        ),
    }
    return cluster | {
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": endpoints}]},
        # Maglev: a server that joins or leaves moves only its share of the keys.
        "load_balancing_policy": {"policies": [{"typed_extension_config": maglev}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": typed(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                explicit_http_config={"http2_protocol_options": {"max_concurrent_streams": 1024, **HTTP2_WINDOWS}},
            )
        },
        # Triton's ready endpoint every second; two misses take a server out (dead, or being restarted by kev-serve
        # after its Python stub died), one answer brings it back; servers without traffic are checked too.
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "1s",
                "no_traffic_interval": "1s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "http_health_check": {"path": "/v2/health/ready", "codec_client_type": "HTTP1"},
            }
        ],
        # Every server failing its checks should not happen; route anyway rather than refuse everything.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        # Failures in a row (connections, gRPC INTERNAL/UNAVAILABLE as 500/503) eject a server for a while, at most
        # half of them at once.
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_gateway_failure": 3,
            "interval": "5s",
            "base_ejection_time": "10s",
            "max_ejection_percent": 50,
        },
        # Triton's own queue refuses past 512 requests a server; these only guard Envoy itself.
        "circuit_breakers": {
            "thresholds": [
                {"max_connections": 1024, "max_pending_requests": 4096, "max_requests": 8192, "max_retries": 64}
            ]
        },
    }


def config(
    listen: tuple[str, int],
    servers: list[Server],
    dns: bool,
    admin: tuple[str, int] | None = None,
    ops: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Envoy's bootstrap: the gRPC listener and the cluster of Triton servers (static addresses, or a DNS name whose
    every address is a server), with the admin interface on `admin` and, on `ops`, only its /ready and Prometheus
    statistics (for a router's own probes and scraping; the admin API itself can stop Envoy)."""
    listeners = [
        listener(
            "kev",
            listen,
            [inference_route()],
            codec_type="AUTO",
            http2_protocol_options={"max_concurrent_streams": 1024, **HTTP2_WINDOWS},
            request_headers_timeout="10s",
            stream_idle_timeout="300s",
        )
    ]
    clusters = [triton_cluster(servers, dns)]
    bootstrap: dict[str, Any] = {}
    if admin is not None:
        bootstrap["admin"] = {"address": socket(*admin)}
    if ops is not None:
        if admin is None:
            raise ValueError("the ops listener serves the admin interface's /ready and statistics: give --admin")
        to_admin = {"cluster": ADMIN_CLUSTER}
        routes = [
            {"match": {"path": "/ready"}, "route": to_admin},
            {"match": {"path": "/stats/prometheus"}, "route": to_admin},
            {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
        ]
        listeners.append(listener("ops", ops, routes))
        endpoint = {"endpoint": {"address": socket(*admin)}}
        clusters.append(
            {
                "name": ADMIN_CLUSTER,
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {"cluster_name": ADMIN_CLUSTER, "endpoints": [{"lb_endpoints": [endpoint]}]},
            }
        )
    bootstrap["static_resources"] = {"listeners": listeners, "clusters": clusters}
    return bootstrap


def host_port(spec: str) -> tuple[str, int]:
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{spec!r} is not HOST:PORT")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=host_port, default=("127.0.0.1", 8010), help="HOST:PORT the router serves")
    servers = parser.add_mutually_exclusive_group(required=True)
    servers.add_argument("--server", type=Server.parse, action="append", help="HOST:GRPC_PORT/HTTP_PORT, repeated")
    servers.add_argument("--dns", type=Server.parse, help="NAME:GRPC_PORT/HTTP_PORT: every address of NAME")
    parser.add_argument("--admin", type=host_port, help="HOST:PORT of Envoy's admin interface (default: none)")
    parser.add_argument("--ops", type=host_port, help="HOST:PORT serving only the admin's /ready and statistics")
    parser.add_argument("--out", type=Path, required=True, help="the bootstrap file to write (.json)")
    args = parser.parse_args()
    upstream = [args.dns] if args.dns else args.server
    bootstrap = config(args.listen, upstream, args.dns is not None, args.admin, args.ops)
    args.out.write_text(json.dumps(bootstrap, indent=1) + "\n")


if __name__ == "__main__":
    main()
