"""The real-inference probe: a one-question System One request to the model through Triton's gRPC port, and whether
its reply holds Kev's answer. tritonserver 2.51 keeps reporting ready after its Python stub died, so readiness alone
proves nothing. kev-serve sends it every KEV_PROBE_INTERVAL_S; `python -m kev_backend.serve.probe` is the same check
for a container's HEALTHCHECK or a Kubernetes probe: Triton's ready endpoint, then the inference, then (with the
gateway on) the gateway's /ready. It prints one line and exits 0 when healthy, 1 when not (2: a bad setting).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import urllib.error
import urllib.request

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from ..settings import ServeSettings, SettingError

PROBE_BODY = b'{"state":"probe","questions":{"ok":{"type":"noul","instructions":"ok?"}}}'


class Probe:
    """Triton's gRPC API through futures: the supervisor's loop never blocks on Triton. One per Triton start (a new
    channel, whose reconnect backoff is kept short so a restarted server is seen at once)."""

    def __init__(self, target: str, model: str) -> None:
        options = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 250),
        ]
        self.channel = grpc.insecure_channel(target, options=options)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.model = model
        request = service_pb2.ModelInferRequest(model_name=model)
        tensor = request.inputs.add(name="REQUEST", datatype="BYTES")
        tensor.shape.extend([1, 1])
        request.outputs.add(name="RESPONSE")
        request.raw_input_contents.append(struct.pack("<I", len(PROBE_BODY)) + PROBE_BODY)
        self.request = request

    def ready(self) -> grpc.Future:
        return self.stub.ServerReady.future(service_pb2.ServerReadyRequest(), timeout=2.0)

    def infer(self, timeout_s: float) -> grpc.Future:
        return self.stub.ModelInfer.future(self.request, timeout=timeout_s)

    def statistics(self) -> grpc.Future:
        return self.stub.ModelStatistics.future(service_pb2.ModelStatisticsRequest(name=self.model), timeout=2.0)

    def close(self) -> None:
        self.channel.close()


def answered(reply: service_pb2.ModelInferResponse) -> bool:
    """The probe's reply holds a Kev answer to its question."""
    try:
        raw = reply.raw_output_contents[0]
        (length,) = struct.unpack_from("<I", raw)
        return "ok" in json.loads(raw[4 : 4 + length])["answers"]
    except (IndexError, struct.error, ValueError, KeyError, TypeError):
        return False


def not_ready(what: str, url: str, timeout_s: float) -> str | None:
    """None when GET `url` answers 200, else why `what` is not ready."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            code = reply.status
    except urllib.error.HTTPError as error:
        code = error.code
    except OSError as error:
        return f"{what} not ready: {url}: {error}"
    return None if code == 200 else f"{what} not ready: {url} answered {code}"


def unhealthy(settings: ServeSettings, timeout_s: float) -> str | None:
    """None when a real inference is answered (and the gateway, when on, is ready), else why not."""
    ready = f"http://{settings.triton_host}:{settings.http_port}/v2/health/ready"
    if why_not := not_ready("Triton", ready, timeout_s):
        return why_not
    probe = Probe(settings.grpc_target, settings.model)
    try:
        reply = probe.infer(timeout_s).result()
    except grpc.RpcError as error:
        return f"inference through Triton failed: {error.code().name}: {error.details()}"
    finally:
        probe.close()
    if not answered(reply):
        return "inference through Triton: the reply holds no answer"
    return not_ready("gateway", f"{settings.gateway_url}/ready", timeout_s) if settings.gateway else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds each step may take")
    args = parser.parse_args()
    try:
        settings = ServeSettings.read()
    except SettingError as error:
        print(f"unhealthy: {error}", flush=True)
        return 2
    why_not = unhealthy(settings, args.timeout)
    print(f"unhealthy: {why_not}" if why_not else "healthy: Triton ready, a real inference answered", flush=True)
    return 1 if why_not else 0


if __name__ == "__main__":
    sys.exit(main())
