"""The real-inference probe: a one-question System One request to the model through Triton's gRPC port, and whether
its reply holds Kev's answer. tritonserver 2.51 keeps reporting ready after its Python stub died, so readiness alone
proves nothing. kev-serve sends it every KEV_PROBE_INTERVAL_S; `python -m kev_backend.serve.supervisor.probe` is the
same check for a container's HEALTHCHECK or a Kubernetes probe: Triton's ready endpoint, the model's heartbeats, then
the inference, then (with the gateway on) the gateway's /ready. It prints one line and exits 0 when healthy, 1 when not
(2: a bad setting).

The probe goes at priority 1 (config.pbtxt: `priority_levels: 2`, clients at the default 2): Triton takes it before
any queued client request, and a client queue at its size limit does not refuse it (each level has its own queue).
It asks for tagged errors (envelope.TAGGED_ERRORS), so a refusal of its own would say so. Its outcome (`verdict`):
- answered: healthy;
- "is not healthy": the stub is gone or stopped: unhealthy at once;
- poisoned: its batch failed while Triton gathered the batch's inputs, for other requests' sake: an INVALID_ARGUMENT
  the model did not tag (a batch-mate's malformed tensor), or the stub's pool in /dev/shm could not grow for the
  batch (a large batch-mate, or /dev/shm too small: kev-serve warns of that at start, and a restart gives no more).
  Triton's backend processed the batch, so it is not stuck on the stub: it says nothing of the model, never
  unhealthy;
- anything else (no reply in time, a refusal, an error of the model's): a failure unless the model progresses over
  the probe's timeout: an instance holds jobs whose beats moved within KEV_PROGRESS_TIMEOUT_S or its beats moved, a
  stub keeps at least 10 % of a CPU busy (preparing a batch, which the heartbeat does not cover), or Triton completes
  other inferences (its statistics). A saturated server is healthy.
An instance whose heartbeat says broken, or that holds jobs with no beat for KEV_PROGRESS_TIMEOUT_S, is unhealthy
whatever the probe got. The health check finds the heartbeats and the stubs through the tritonserver serving
GRPC_PORT (its argv names its shared-memory prefix); without them it judges by Triton's statistics alone. The
gateway's /ready asks an inference of its own at the clients' priority: for a busy model its /health is enough.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from ...protocol import envelope
from ...settings import ServeSettings, SettingError
from ..stub.heartbeat import Pulse
from . import progress
from .shm import SHM_ERROR

PROBE_BODY = b'{"state":"probe","questions":{"ok":{"type":"noul","instructions":"ok?"}}}'
QUEUE_FULL = "Exceeds maximum queue size"  # Triton's refusal when the model's queue is full
UNHEALTHY = "is not healthy"  # the Python backend's refusal once its stub is gone or stopped
# The probe's priority level: the first of config.pbtxt's two (clients' requests default to the second).
PRIORITY = 1
ANSWERED, UNHEALTHY_STUB, POISONED, FAILED = "answered", "unhealthy", "poisoned", "failed"


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
        request.parameters["priority"].uint64_param = PRIORITY
        request.parameters[envelope.TAGGED_ERRORS].bool_param = True
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


def verdict(code: grpc.StatusCode, details: str) -> str:
    """What a failed probe says: UNHEALTHY_STUB (the stub is gone or stopped), POISONED (its batch failed for other
    requests' sake while Triton gathered its inputs: a batch-mate's malformed tensor, an INVALID_ARGUMENT the model
    did not tag as it never judged it; or a pool in /dev/shm too small for the batch) or FAILED (no answer, maybe for
    the model's sake: judged with its progress)."""
    if envelope.read_tagged(details) is not None:  # the model's own judgement of the probe
        return FAILED
    if UNHEALTHY in details:
        return UNHEALTHY_STUB
    if code == grpc.StatusCode.INVALID_ARGUMENT or SHM_ERROR in details:
        return POISONED
    return FAILED


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


def stuck(pulses: dict[str, tuple[Pulse, float]], progress_timeout_s: float) -> str | None:
    """Why the heartbeats (pulse, seconds since written) say an instance must be restarted, None when none does."""
    for name, (pulse, age) in sorted(pulses.items()):
        if pulse.broken:
            return f"model instance {name} reports its engine broken"
        if pulse.jobs and age >= progress_timeout_s:
            return f"model instance {name} holds {pulse.jobs} job(s) and its beats have not moved for {age:.0f} s"
    return None


def busy(pulses: dict[str, tuple[Pulse, float]], progress_timeout_s: float, within_s: float) -> bool:
    """An instance holds jobs whose beats moved within the progress timeout, or some instance's beats moved within
    the last `within_s` seconds (the probe's wait)."""
    return any((p.jobs and age < progress_timeout_s) or age <= within_s for p, age in pulses.values())


def heartbeats(server: progress.Served | None) -> dict[str, tuple[Pulse, float]]:
    """The heartbeats of `server`'s instances; none without a server to read them from."""
    return progress.pulses_on_disk(server.prefix) if server is not None else {}


class Activity:
    """What the model does from a probe's start on, for the health check: Triton's completed inferences, the stubs'
    heartbeats and CPU time."""

    def __init__(self, probe: Probe, server: progress.Served | None, progress_timeout_s: float) -> None:
        self.probe, self.server, self.progress_timeout_s = probe, server, progress_timeout_s
        self.completed = completed(probe)
        self.cpu = server.stubs_cpu_seconds() if server is not None else 0.0
        self.started = time.monotonic()

    def progressed(self, timeout_s: float) -> bool:
        """The model progresses within `timeout_s` of the start (polled until then): an instance holds jobs whose
        beats moved within the progress timeout, or its beats moved since the start; a stub kept at least
        progress.BUSY_CPU_SHARE of a CPU busy since the start (preparing a batch, which the heartbeat does not
        cover); or Triton completed more inferences."""
        deadline = self.started + timeout_s
        while True:
            since_start = time.monotonic() - self.started
            pulses = heartbeats(self.server)
            if busy(pulses, self.progress_timeout_s, since_start) or self.worked() or self.finished():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def worked(self) -> bool:
        waited = time.monotonic() - self.started
        if self.server is None or waited < 0.5:  # CPU time counts in 10 ms ticks: too coarse over less
            return False
        return self.server.stubs_cpu_seconds() - self.cpu >= progress.BUSY_CPU_SHARE * waited

    def finished(self) -> bool:
        now = completed(self.probe)
        return self.completed is not None and now is not None and now > self.completed


def ask(probe: Probe, timeout_s: float) -> tuple[str, str]:
    """The probe's outcome (ANSWERED, or a `verdict`) and what Triton said."""
    try:
        reply = probe.infer(timeout_s).result()
    except grpc.RpcError as error:
        details = error.details() or ""
        return verdict(error.code(), details), f"{error.code().name}: {details}"
    return (ANSWERED, "") if answered(reply) else (FAILED, "the reply holds no answer")


def gateway_not_ready(settings: ServeSettings, timeout_s: float, busy: Callable[[], bool]) -> str | None:
    """None when the gateway is ready: its /ready (its own inference within 2 s), or, while the model is `busy()`, its
    /health: the gateway's inference waits at the clients' priority, behind a busy server's queue."""
    why_not = not_ready("gateway", f"{settings.gateway_url}/ready", timeout_s)
    if why_not is None or (busy() and not_ready("gateway", f"{settings.gateway_url}/health", timeout_s) is None):
        return None
    return why_not


def check(settings: ServeSettings, timeout_s: float) -> tuple[bool, str]:
    """Whether the model answers a real inference, or is busy with others' (and the gateway, when on, is up), and
    what was found."""
    ready = f"http://{settings.triton_host}:{settings.http_port}/v2/health/ready"
    if why_not := not_ready("Triton", ready, timeout_s):
        return False, why_not
    server = progress.served(settings.grpc_port)
    if why_not := stuck(heartbeats(server), settings.progress_timeout_s):
        return False, why_not
    probe = Probe(settings.grpc_target, settings.model)
    try:
        activity = Activity(probe, server, settings.progress_timeout_s)
        outcome, detail = ask(probe, timeout_s)
        if outcome == ANSWERED:
            found = "Triton ready, a real inference answered"
        elif outcome == POISONED:
            found = f"Triton answered; other requests failed the probe's batch ({detail})"
        elif outcome == FAILED and activity.progressed(timeout_s):
            found = f"Triton busy: the probe was not answered ({detail}) while the model progressed"
        else:
            return False, f"inference through Triton failed: {detail}"

        def busy() -> bool:
            return outcome != ANSWERED or activity.progressed(timeout_s)

        if settings.gateway and (why_not := gateway_not_ready(settings, timeout_s, busy)):
            return False, why_not
        return True, found
    finally:
        probe.close()


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
