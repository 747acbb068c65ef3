"""The gateway's FastAPI app (its routes and middleware) and `kev-gateway`, which serves it with uvicorn behind the
hardened front (front.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from ...settings import GatewaySettings, gateway_address
from ..version import version_line
from . import front
from .middleware import Guard, Observe
from .replies import REQUEST_ID
from .service import Gateway

# Connections the kernel queues before the gateway accepts them (capped by net.core.somaxconn): room for a burst of
# new connections, as many as the front's accepts take a moment to catch up with.
BACKLOG = 4096


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings.read()
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await gateway.start()
        # Several workers: each copies its gauges into the shared metrics files, for a scrape another one answers.
        sync = asyncio.ensure_future(gateway.metrics.keep_synced(gateway)) if gateway.metrics.multiprocess else None
        yield
        if sync is not None:
            sync.cancel()
        gateway.metrics.close()
        await gateway.stop()

    app = FastAPI(title="Kev System One gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    app.post("/v1/systemone")(gateway.route(gateway.system_one))
    app.post("/v1/systemone/separate")(gateway.route(gateway.separate))
    app.post("/v1/systemone/permute")(gateway.route(gateway.permute))
    app.get("/v1/models")(gateway.models)
    app.get("/ready")(gateway.ready)
    app.get("/metrics")(gateway.prometheus)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # add_middleware puts each new layer outside the ones before it.
    app.add_middleware(Guard, metrics=gateway.metrics, api_key=settings.api_key)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"],
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=[REQUEST_ID, "server-timing"],
    )
    app.add_middleware(Observe, metrics=gateway.metrics, access_log=settings.access_log)
    return app


def log_config() -> dict[str, Any]:
    """uvicorn's logging, with this module's logger on its handler (every worker process configures it)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["kev_backend"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    # The access log: its JSON lines alone on stdout, one a request (access.py).
    config["formatters"]["kev_access"] = {"format": "%(message)s"}
    config["handlers"]["kev_access"] = {
        "formatter": "kev_access", "class": "logging.StreamHandler", "stream": "ext://sys.stdout"
    }  # fmt: skip
    config["loggers"]["kev_backend.serve.gateway.access"] = {
        "handlers": ["kev_access"], "level": "INFO", "propagate": False
    }  # fmt: skip
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description="Kev System One gateway in front of Triton")
    parser.add_argument("--version", action="version", version=version_line("kev-gateway"))
    host, port = gateway_address()
    parser.add_argument("--host", default=host, help="listening address (GATEWAY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=port, help="listening port (GATEWAY_PORT, default 8009)")
    parser.add_argument("--triton", help="Triton gRPC address (TRITON_GRPC_URL, default 127.0.0.1:8001)")
    parser.add_argument("--metrics", help="Triton metrics address (TRITON_METRICS_URL, default 127.0.0.1:8002)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (their metrics are summed)")
    args = parser.parse_args()
    front.raise_descriptor_limit()  # before uvicorn forks any worker: they inherit it
    settings = GatewaySettings.read()  # read here too, so a bad setting stops the start with its message
    if args.triton:  # the app factory runs in uvicorn's workers, which inherit the environment
        os.environ["TRITON_GRPC_URL"] = args.triton
    if args.metrics:
        os.environ["TRITON_METRICS_URL"] = args.metrics
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    import uvicorn

    with metrics_directory(args.workers):
        serve(uvicorn, args, settings)


@contextlib.contextmanager
def metrics_directory(workers: int) -> Iterator[None]:
    """With several workers, a fresh directory for prometheus_client's multiprocess mode for this start, removed
    when it ends: each worker writes its metrics there and a scrape, whichever worker answers it, reads them all. It
    is named before uvicorn starts the workers (new processes that import prometheus_client, which reads it then);
    a directory left by another start would add that start's counts to this one's. One worker keeps its metrics in
    its own memory."""
    if workers == 1:
        yield
        return
    directory = tempfile.mkdtemp(prefix="kev-gateway-metrics-")  # mode 0700: the gateway's user alone
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    try:
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def serve(uvicorn: Any, args: argparse.Namespace, settings: GatewaySettings) -> None:
    uvicorn.run(
        "kev_backend.serve.gateway.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        http="kev_backend.serve.gateway.front:GuardedProtocol",
        ws="none",
        backlog=BACKLOG,
        timeout_keep_alive=max(1, round(settings.keepalive_timeout_s)),  # unused: GuardedProtocol keeps its own
        log_level="warning",
        log_config=log_config(),
        access_log=False,
    )
