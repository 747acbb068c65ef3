"""The real-inference probe: a one-question System One request to the model through Triton's gRPC port, and whether
its reply holds Kev's answer. tritonserver 2.51 keeps reporting ready after its Python stub died, so readiness alone
proves nothing. kev-serve sends it every KEV_PROBE_INTERVAL_S; `python -m kev_backend.serve.probe` is the same check
for a container's HEALTHCHECK or a Kubernetes probe: Triton's ready endpoint, then the inference, then (with the
gateway on) the gateway's /ready. It prints one line and exits 0 when healthy, 1 when not (2: a bad setting).

A busy server is healthy: a probe whose inference timed out in Triton's queue, or was refused by the full queue,
while Triton completed other inferences within the probe's timeout (its statistics), is not a failure. kev-serve
judges its own probes so; this keeps a container's liveness probe from restarting a server for being saturated.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
import urllib.error
import urllib.request

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from ..settings import ServeSettings, SettingError

PROBE_BODY = b'{"state":"probe","questions":{"ok":{"type":"noul","instructions":"ok?"}}}'
QUEUE_FULL = "Exceeds maximum queue size"  # Triton's refusal when the model's queue is full


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


def successes(reply: service_pb2.ModelStatisticsResponse) -> int:
    """Inferences Triton has completed for the model, from its statistics."""
    return sum(s.inference_stats.success.count for s in reply.model_stats)


def completed(probe: Probe) -> int | None:
    """successes, None if Triton does not say."""
    try:
        return successes(probe.statistics().result())
    except grpc.RpcError:
        return None


def progressing(probe: Probe, before: int | None, deadline: float) -> bool:
    """Triton completes inferences: more than `before` by `deadline` (polled)."""
    if before is None:
        return False
    while (now := completed(probe)) is None or now <= before:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def check(settings: ServeSettings, timeout_s: float) -> tuple[bool, str]:
    """Whether a real inference is answered, or Triton is busy answering others (and the gateway, when on, is up),
    and what was found."""
    ready = f"http://{settings.triton_host}:{settings.http_port}/v2/health/ready"
    if why_not := not_ready("Triton", ready, timeout_s):
        return False, why_not
    probe = Probe(settings.grpc_target, settings.model)
    try:
        before, started = completed(probe), time.monotonic()
        try:
            reply = probe.infer(timeout_s).result()
        except grpc.RpcError as error:
            detail = f"{error.code().name}: {error.details()}"
            queued = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED or QUEUE_FULL in detail
            if not (queued and progressing(probe, before, started + timeout_s)):
                return False, f"inference through Triton failed: {detail}"
            # The gateway's /ready needs an inference of its own within 2 s, which a busy server cannot give.
            if settings.gateway and (why_not := not_ready("gateway", f"{settings.gateway_url}/health", timeout_s)):
                return False, why_not
            return True, f"Triton busy: the probe's inference was queued or refused ({detail}) while others completed"
    finally:
        probe.close()
    if not answered(reply):
        return False, "inference through Triton: the reply holds no answer"
    if settings.gateway and (why_not := not_ready("gateway", f"{settings.gateway_url}/ready", timeout_s)):
        return False, why_not
    return True, "Triton ready, a real inference answered"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds each step may take")
    args = parser.parse_args()
    try:
        settings = ServeSettings.read()
    except SettingError as error:
        print(f"unhealthy: {error}", flush=True)
        return 2
    healthy, found = check(settings, args.timeout)
    print(f"{'healthy' if healthy else 'unhealthy'}: {found}", flush=True)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
