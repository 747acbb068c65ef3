"""Envoy in front of several Triton servers (one per GPU, each with its own state bank), routing every request to the
server whose bank may hold its state: MAGLEV consistent hashing on the state key header (x-kev-state-key, sent by
kev_backend.serve.client and the gateway), bounded load so one hot state cannot swamp its server, and active health
checks so a dead server's keys move to the others within about two seconds (only its keys move: MAGLEV).

    python -m kev_backend.serve.router --listen 127.0.0.1:8010 --server 127.0.0.1:8101/8100 \\
        --server 127.0.0.1:8201/8200 --out envoy.json          # N servers on one host (gRPC port / HTTP port)
    python -m kev_backend.serve.router --listen 0.0.0.0:8001 --dns kev-triton:8001/8000 --out envoy.json
                                                                # N pods behind a headless Service
    envoy --mode validate -c envoy.json && envoy -c envoy.json

The router speaks gRPC (HTTP/2) to clients and servers alike: Triton's gRPC port carries inference, its HTTP port
only the health check (GET /v2/health/ready). A request the chosen server refuses at connection level is retried
once on another server (inference is a pure function of the request, so a retry is safe). Requests without the
header are spread at random.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protocol.systemone import STATE_KEY_HEADER

CLUSTER = "kev_triton"
# Bounded load (Envoy's hash_balance_factor, in percent): no server takes more than 1.5x the mean of requests in
# flight; a hot state spills over to the next server on its ring instead of queueing behind itself.
BALANCE_FACTOR = 150
HTTP_CONNECTION_MANAGER = "envoy.filters.network.http_connection_manager"


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


def config(listen: tuple[str, int], servers: list[Server], dns: bool, admin: tuple[str, int] | None) -> dict:
    """Envoy's bootstrap: one listener, one cluster of Triton servers (static addresses, or a DNS name whose every
    address is a server: STRICT_DNS on a headless Service)."""
    route = {
        "cluster": CLUSTER,
        "timeout": "120s",
        "hash_policy": [{"header": {"header_name": STATE_KEY_HEADER}}],
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset",
            "num_retries": 1,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": typed("envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"),
                }
            ],
            "host_selection_retry_max_attempts": 3,
        },
    }
    routes = [{"match": {"prefix": "/"}, "route": route}]
    router = typed("envoy.extensions.filters.http.router.v3.Router")
    manager = typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="kev",
        codec_type="AUTO",
        route_config={
            "name": "kev",
            "virtual_hosts": [{"name": "kev", "domains": ["*"], "routes": routes}],
        },
        http_filters=[{"name": "envoy.filters.http.router", "typed_config": router}],
    )
    endpoints = [
        {"endpoint": {"address": socket(s.host, s.grpc_port), "health_check_config": {"port_value": s.http_port}}}
        for s in servers
    ]
    cluster = {
        "name": CLUSTER,
        "type": "STRICT_DNS" if dns else "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "MAGLEV",
        "common_lb_config": {"consistent_hashing_lb_config": {"hash_balance_factor": BALANCE_FACTOR}},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": typed(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                explicit_http_config={"http2_protocol_options": {}},
            )
        },
        "load_assignment": {"cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": endpoints}]},
        # Triton's ready endpoint on its HTTP port, every second; two misses take a server out (a dead or restarting
        # server: kev-serve restarts one whose Python stub died), one answer brings it back. no_traffic_interval: a
        # server that gets no traffic is still checked every second.
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
    }
    if dns:
        cluster["dns_lookup_family"] = "V4_ONLY"
        cluster["dns_refresh_rate"] = "5s"
        cluster["respect_dns_ttl"] = False
    bootstrap: dict[str, Any] = {
        "static_resources": {
            "listeners": [
                {
                    "name": "kev",
                    "address": socket(*listen),
                    "filter_chains": [{"filters": [{"name": HTTP_CONNECTION_MANAGER, "typed_config": manager}]}],
                }
            ],
            "clusters": [cluster],
        }
    }
    if admin is not None:  # statistics and cluster health, for operators and tests; keep it on loopback
        bootstrap["admin"] = {"address": socket(*admin)}
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
    parser.add_argument("--out", type=Path, required=True, help="the bootstrap file to write (.json)")
    args = parser.parse_args()
    upstream = [args.dns] if args.dns else args.server
    args.out.write_text(json.dumps(config(args.listen, upstream, args.dns is not None, args.admin), indent=1) + "\n")


if __name__ == "__main__":
    main()
