"""The image's HEALTHCHECK: healthy only when a real inference is answered, not merely when Triton says ready.

tritonserver 2.51 keeps reporting ready after its Python stub died (every request then fails), so the check is:
1. Triton's ready endpoint (HTTP GET /v2/health/ready on its loopback port);
2. a real inference through Triton's gRPC port: kev-serve's own probe (kev_backend.serve.supervisor.Probe, the
   one-question request it sends every second) and its verdict (`answered`: the reply holds Kev's answer);
3. with the gateway on (GATEWAY != 0), the gateway's GET /ready, which is 200 only while its own inference through
   Triton succeeded in the last 2 s: the front door answers too.
Ports, addresses and the model come from the environment variables kev-serve reads, with its defaults (HTTP_PORT,
GRPC_PORT, TRITON_ADDRESS, GATEWAY, GATEWAY_PORT, BIND_ADDRESS, KEV_TRITON_MODEL). Exit 0 = healthy, 1 = unhealthy
with one line saying why. KEV_HEALTHCHECK_TIMEOUT_S (5) bounds each step.
Usage: python build/image/healthcheck.py      (in the image: the HEALTHCHECK; podman healthcheck run CONTAINER)
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

import grpc

from kev_backend.serve.supervisor import Probe, answered


def loopback(address: str) -> str:
    """Where to reach a server bound to `address`: loopback when it binds every address."""
    if address in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{address}]" if ":" in address else address


class Config:
    def __init__(self, env: dict[str, str]) -> None:
        self.triton_host = loopback(env.get("TRITON_ADDRESS") or "127.0.0.1")
        self.http_port = int(env.get("HTTP_PORT") or 8000)
        self.grpc_target = f"{self.triton_host}:{int(env.get('GRPC_PORT') or 8001)}"
        self.model = env.get("KEV_TRITON_MODEL") or "kev"
        self.gateway = env.get("GATEWAY", "1") != "0"
        gateway_host = loopback(env.get("BIND_ADDRESS") or "127.0.0.1")
        self.gateway_url = f"http://{gateway_host}:{int(env.get('GATEWAY_PORT') or 8009)}"


def get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def check(config: Config, timeout: float) -> str | None:
    """None when healthy, else why not."""
    ready = f"http://{config.triton_host}:{config.http_port}/v2/health/ready"
    try:
        if (status := get(ready, timeout)) != 200:
            return f"Triton not ready: {ready} answered {status}"
    except OSError as error:
        return f"Triton not ready: {ready}: {error}"
    probe = Probe(config.grpc_target, config.model)
    try:
        reply = probe.infer(timeout).result()
    except grpc.RpcError as error:
        return f"inference through Triton failed: {error.code().name}: {error.details()}"
    finally:
        probe.close()
    if not answered(reply):
        return "inference through Triton: the reply holds no answer"
    if config.gateway:
        url = f"{config.gateway_url}/ready"
        try:
            if (status := get(url, timeout)) != 200:
                return f"gateway not ready: {url} answered {status}"
        except OSError as error:
            return f"gateway not ready: {url}: {error}"
    return None


def main() -> int:
    config = Config(dict(os.environ))
    why_not = check(config, float(os.environ.get("KEV_HEALTHCHECK_TIMEOUT_S", "5")))
    print(f"unhealthy: {why_not}" if why_not else "healthy: Triton ready, a real inference answered", flush=True)
    return 1 if why_not else 0


if __name__ == "__main__":
    sys.exit(main())
