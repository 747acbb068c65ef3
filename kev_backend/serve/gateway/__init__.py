"""System One gateway: Kev 1.0's HTTP API in front of Triton, for the TypeSafe SDK and other System One clients.

`kev-gateway` serves `POST /v1/systemone`, `/v1/systemone/separate`, `/v1/systemone/permute` and `GET /v1/models`
with Kev's bodies, 422 messages (FastAPI's `detail` form), `x-typesafe-request-id` and `server-timing` headers and
an optional bearer key (KEV_API_KEY) on /v1/*. It holds no model: every request is one call to Triton over one
shared async gRPC channel (/separate and /permute too: the model answers many questions on one state, so the state
travels once). Overload is answered at once — 429 when the gateway already has its limit of requests in flight or
arriving, 529 when Triton's queue refuses — with `retry-after`, never queued without bound.

Hostile or unlucky clients cost the gateway a bounded amount:
- connections, request heads and URLs, slow heads and bodies, idle sockets: `front`;
- bodies (byte limits, zstd and gzip bombs, bytes arriving): `bodies`;
- a request's in-flight slots are taken once its body is read and parsed (one per question of /separate, one per
  permutation of /permute); bodies still arriving are bounded apart (KEV_GATEWAY_MAX_ARRIVING, _ARRIVING_BYTES);
- a client that goes away while its request waits on Triton has that request cancelled (a gRPC call cancelled while
  queued costs the model nothing);
- Triton's failures are reported to the request they are about, with neutral messages otherwise (`replies`);
  any other failure is a JSON 500 naming the request id, logged in one line.
Every error body is JSON `{"detail": ..., "request_id": ...}` (the id also in `x-typesafe-request-id`, and sent to
Triton with the request). Every request gets one JSON line in the access log on stdout (`access`). CORS preflights
are answered without the key, and every response, 401s and 500s included, carries CORS headers.

Operations: `GET /health` (the process is up), `GET /ready` (200 only when a real inference through Triton succeeded
in the last 2 s: a Triton whose Python stub crashed still reports ready itself) and `GET /metrics`
(prometheus_client, summed over `--workers`: `kev_gateway_requests_total{route,status}`,
`kev_gateway_request_duration_seconds{route,status}`, `kev_gateway_errors_total{reason}`, `kev_gateway_in_flight`,
`kev_gateway_arriving`, `kev_gateway_arriving_bytes`, `kev_gateway_connections`,
`kev_gateway_connection_events_total{event}`, `kev_gateway_build_info{version}`), none behind the key. `GET
/v1/models` names what answers (`provenance`: the model instances' `kev_build_info`).

Settings: kev_backend.settings.GatewaySettings (docs/configuration.md). The request limits are the model's: read
from Triton's model config (its parameters with the same KEV_* overrides) once Triton answers, so both doors agree.

The package, by job: `app` (the FastAPI app and `kev-gateway`), `front` (connections), `bodies` (reading and
decoding bodies), `middleware` (Observe, CORS, Guard), `access` (the access log), `service` (the gateway's state,
admission and each route's handler), `answering` (the pieces of the answers: /permute's orders, truncation marks,
calls cancelled together, a client that goes away), `replies` (refusals and Triton's errors as responses),
`observability` (GET /metrics, the serving statistics, readiness). `python -m kev_backend.serve.gateway` runs
`kev-gateway`."""

from .app import create_app, main

__all__ = ["create_app", "main"]
