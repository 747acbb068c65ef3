"""Locust load test for Kev on Triton: `locust -f loadtest/kev.py`.

Users (pick one or more by class name):
  TritonGrpcUser   tritonclient.grpc against Triton's gRPC port (--triton-grpc, default 127.0.0.1:8001)
  TritonHttpUser   tritonclient.http against Triton's HTTP port (--triton-http, default 127.0.0.1:8000)
  GatewayUser      POST /v1/systemone through the System One gateway (--host, e.g. http://127.0.0.1:8009)
Traffic: --shape short6 | long5 | mix (the 240 jevbench-240 cases) | grow (turns of growing conversations: each state
the turn before's plus a message) and --repeat, the share of requests that reuse a state already sent (0: every state
new; 1: one state again and again).

Headless, 64 users over gRPC for 60 s, results as CSV:
  locust -f loadtest/kev.py TritonGrpcUser --headless -u 64 -r 64 -t 60s --shape short6 --csv out/kev
"""

from __future__ import annotations

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any gRPC channel: tritonclient.grpc under locust's gevent

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from locust import FastHttpUser, User, constant, events, task  # noqa: E402

from kev_backend.dev.workloads import Traffic  # noqa: E402
from kev_backend.serve.client import KevClient, KevError  # noqa: E402
from kev_backend.settings import api_key  # noqa: E402


@events.init_command_line_parser.add_listener
def options(parser) -> None:
    parser.add_argument("--shape", choices=Traffic.SHAPES, default="short6", help="request shape")
    parser.add_argument("--repeat", type=float, default=0.0, help="share of requests on a state already sent")
    parser.add_argument("--triton-grpc", default="127.0.0.1:8001")
    parser.add_argument("--triton-http", default="127.0.0.1:8000")
    parser.add_argument("--model", default="kev")


def traffic(user: User) -> Traffic:
    o = user.environment.parsed_options
    # Each user draws its own stream; seeds differ so new states stay new across users.
    return Traffic(o.shape, o.repeat, seed=hash((os.getpid(), id(user))) & 0xFFFFFFFF)


# The Triton clients users opened and have not closed: each user closes its own on stop, and whatever a user stopped
# before its on_stop left open is closed when locust quits.
OPEN_CLIENTS: set[KevClient] = set()


def close(kev: KevClient) -> None:
    """Close `kev`'s channel, and make sure nothing closes it again.

    tritonclient's InferenceServerClient.__del__ closes its gRPC channel once more when it is collected, and under
    grpc's gevent mode every close counts a channel off (cygrpc.gevent_decrement_channel_count) under a C++ mutex,
    g_greenlets_mu. The thread in gevent's threadpool that waits for gRPC's callbacks holds that mutex while it waits
    for the GIL; when the interpreter starts finalizing then, CPython ends that thread with the mutex still held, and
    the collection of the clients during finalization then blocks on it forever: locust printed its summary and never
    exited, and SIGTERM did nothing (the main thread sits in a futex, never back in Python; seen about one run in
    five). Closed here once, the collected client has nothing left to close.
    """
    OPEN_CLIENTS.discard(kev)
    kev.close()
    inner = getattr(kev, "_client", None)  # KevClient's tritonclient client
    if inner is not None:
        inner.close = lambda: None  # __del__ calls self.close(): the instance's no-op, not the method


@events.quitting.add_listener
def close_open_clients(environment, **_kwargs) -> None:
    if OPEN_CLIENTS and environment.runner is not None:
        # SIGTERM: locust fires quitting before it stops the users. Stopped first, their on_stop closes their clients,
        # and no request in flight is cut off by its channel closing (a failure in the summary).
        environment.runner.stop()
    while OPEN_CLIENTS:
        close(next(iter(OPEN_CLIENTS)))


class TritonUser(User):
    abstract = True
    wait_time = constant(0)
    protocol = "grpc"

    def on_start(self) -> None:
        o = self.environment.parsed_options
        url = o.triton_grpc if self.protocol == "grpc" else o.triton_http
        self.kev = KevClient(url, self.protocol, o.model)
        OPEN_CLIENTS.add(self.kev)
        self.traffic = traffic(self)

    def on_stop(self) -> None:
        kev = getattr(self, "kev", None)  # None: stopped before on_start had made it
        if kev in OPEN_CLIENTS:
            close(kev)

    @task
    def score(self) -> None:
        body = self.traffic.next()
        started = time.perf_counter()
        error, size = None, 0
        try:
            size = len(json.dumps(self.kev.score(body)))
        except KevError as e:
            error = e
        self.environment.events.request.fire(
            request_type=self.protocol,
            name=self.environment.parsed_options.shape,
            response_time=(time.perf_counter() - started) * 1000,
            response_length=size,
            exception=error,
            context={},
        )


class TritonGrpcUser(TritonUser):
    protocol = "grpc"


class TritonHttpUser(TritonUser):
    protocol = "http"


class GatewayUser(FastHttpUser):
    """System One clients: POST /v1/systemone to the gateway (--host); KEV_API_KEY is sent when set."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.traffic = traffic(self)
        key = api_key()
        self.headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}

    @task
    def score(self) -> None:
        body = json.dumps(self.traffic.next())
        name = self.environment.parsed_options.shape
        with self.client.post(
            "/v1/systemone", data=body, headers=self.headers, name=name, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {response.text[:200]}")
