"""System One gateway: Kev 1.0's HTTP API in front of Triton, for the TypeSafe SDK and other System One clients.

`kev-gateway` serves `POST /v1/systemone`, `/v1/systemone/separate`, `/v1/systemone/permute` and `GET /v1/models`
with Kev's bodies, 422 messages (FastAPI's `detail` form), `x-typesafe-request-id` and `server-timing` headers and
an optional bearer key (KEV_API_KEY). It holds no model: every question goes to Triton over one shared async gRPC
channel. Overload is answered at once — 429 when the gateway already has its limit of requests in flight, 529 when
Triton's queue refuses — with `retry-after`, never queued without bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from pydantic import BaseModel, Field, ValidationError

from .client import AsyncKevClient, KevError
from .systemone import RequestError, parse_request, round4

REQUEST_ID = "x-typesafe-request-id"


@dataclass(frozen=True)
class Settings:
    triton_url: str = "127.0.0.1:8001"
    model: str = "kev"
    api_key: str | None = None
    max_in_flight: int = 512  # requests the gateway holds at once; more get 429 at once
    timeout_s: float = 120.0
    retry_after_s: int = 1
    release_date: str = "2026-10-01"

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        return cls(
            triton_url=env.get("TRITON_GRPC_URL", cls.triton_url),
            model=env.get("KEV_TRITON_MODEL", cls.model),
            api_key=env.get("KEV_API_KEY") or None,
            max_in_flight=int(env.get("KEV_GATEWAY_MAX_IN_FLIGHT", cls.max_in_flight)),
            timeout_s=float(env.get("KEV_GATEWAY_TIMEOUT_S", cls.timeout_s)),
            release_date=env.get("KEV_RELEASE_DATE", cls.release_date),
        )


class PermuteBody(BaseModel):
    request: dict[str, Any]
    question: str
    n_perm: int = Field(6, ge=1, le=64)
    seed: int = 0


class Overloaded(Exception):
    pass


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    content = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    return Response(content, status_code=status, media_type="application/json", headers=headers)


def decode_body(raw: bytes, encoding: str) -> bytes:
    """Request bodies as the TypeSafe SDK sends them: zstd-compressed past 1 KiB when zstd is available."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding == "zstd":
        try:
            from backports.zstd import decompress
        except ImportError:  # Python 3.14+
            from compression.zstd import decompress  # type: ignore[import-not-found, no-redef]
        return decompress(raw)
    if encoding == "gzip":
        import gzip

        return gzip.decompress(raw)
    raise RequestError(f"unsupported content-encoding {encoding!r}", status=415)


def nested(error: RequestError, *prefix: str) -> RequestError:
    """A request validated inside an envelope (`/permute`'s `request`): its error locations under that field."""
    if isinstance(error.detail, str):
        return error
    detail = [{**e, "loc": ["body", *prefix, *e["loc"][1:]]} for e in error.detail]
    return RequestError(detail, error.status)


def single_question(raw: dict[str, Any], qid: str, question: dict[str, Any]) -> dict[str, Any]:
    body = {"state": raw.get("state"), "questions": {qid: question}}
    if "model" in raw:
        body["model"] = raw["model"]
    return body


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.kev: AsyncKevClient | None = None
        self.in_flight = 0

    async def start(self) -> None:
        self.kev = AsyncKevClient(self.settings.triton_url, "grpc", self.settings.model, self.settings.timeout_s)

    async def stop(self) -> None:
        if self.kev is not None:
            await self.kev.close()

    @contextlib.contextmanager
    def admitted(self, n: int = 1):
        if self.in_flight + n > self.settings.max_in_flight:
            raise Overloaded(f"{self.in_flight} requests in flight (limit {self.settings.max_in_flight})")
        self.in_flight += n
        try:
            yield
        finally:
            self.in_flight -= n

    async def score(self, body: dict[str, Any] | bytes, request_id: str) -> bytes:
        assert self.kev is not None
        return await self.kev.score_raw(body, request_id)

    async def system_one(self, raw: bytes, request_id: str) -> Response:
        parse_request(raw)  # Kev's 422s before any model work
        with self.admitted():
            return Response(await self.score(raw, request_id), media_type="application/json")

    async def separate(self, raw: bytes, request_id: str) -> Response:
        record = parse_request(raw)
        body = json.loads(raw)
        parts = [single_question(body, q.id, body["questions"][q.id]) for q in record.questions]
        with self.admitted(len(parts)):
            replies = await asyncio.gather(*(self.score(p, f"{request_id}-{i}") for i, p in enumerate(parts)))
        answers: dict[str, Any] = {}
        input_tokens = output_tokens = 0
        latency = 0.0
        for reply in map(json.loads, replies):
            answers.update(reply["answers"])
            input_tokens += reply["usage"]["input_tokens"]
            output_tokens += reply["usage"]["output_tokens"]
            latency += reply["latency_ms"]
        merged = {
            "model": record.model,
            "answers": answers,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
            "latency_ms": round(latency, 1),
        }
        return json_response(merged)

    async def permute(self, raw: bytes, request_id: str) -> Response:
        try:
            envelope = PermuteBody.model_validate_json(raw)
        except ValidationError as error:
            detail = [{**e, "loc": ["body", *e["loc"]]} for e in error.errors(include_url=False)]
            raise RequestError(json.loads(json.dumps(detail, default=lambda _: {}))) from None
        try:
            record = parse_request(envelope.request)
        except RequestError as error:
            raise nested(error, "request") from None
        question = next((q for q in record.questions if q.id == envelope.question), None)
        if question is None or question.type != "choice":
            raise RequestError("question must be an existing choice question")
        original = envelope.request["questions"][question.id]
        keys = list(original["criteria"])
        rng = random.Random(envelope.seed)
        orders = [keys]
        for _ in range(envelope.n_perm - 1):
            order = list(keys)
            rng.shuffle(order)
            orders.append(order)
        parts = [
            single_question(
                envelope.request, question.id, {**original, "criteria": {k: original["criteria"][k] for k in order}}
            )
            for order in orders
        ]
        with self.admitted(len(parts)):
            replies = await asyncio.gather(*(self.score(p, f"{request_id}-{i}") for i, p in enumerate(parts)))
        runs = []
        for order, reply in zip(orders, map(json.loads, replies)):
            answer = reply["answers"][question.id]
            runs.append(
                {
                    "order": order,
                    "probabilities": answer["probabilities"],
                    "choice": answer["choice"],
                    "latency_ms": reply["latency_ms"],
                }
            )
        spread = {
            k: round4(max(r["probabilities"][k] for r in runs) - min(r["probabilities"][k] for r in runs)) for k in keys
        }
        return json_response({"runs": runs, "argmax_stable": len({r["choice"] for r in runs}) == 1, "spread": spread})

    async def models(self) -> Response:
        assert self.kev is not None
        try:
            parameters = {
                k: v.get("string_value") for k, v in (await self.kev.model_config()).get("parameters", {}).items()
            }
        except Exception:  # the cards still answer while Triton is starting
            parameters = {}
        extras = {
            "backend": "triton",
            "triton_model": self.settings.model,
            "max_state_tokens": int(parameters.get("max_state_tokens") or 65_536),
            "max_row_tokens": int(parameters.get("max_row_tokens") or 73_728),
            "truncate_states": False,
            "dtype": parameters.get("dtype") or None,
        }
        cards = [
            {
                "name": "kev-latest",
                "description": "Kev decision model (noul, choice, score), served by Triton.",
                "release_date": self.settings.release_date,
                **extras,
            },
            {
                "name": "jev-latest",
                "description": "Alias of kev-latest for TypeSafe SDK defaults.",
                "release_date": self.settings.release_date,
                **extras,
            },
        ]
        return json_response({"models": cards})


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="Kev System One gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"],
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=[REQUEST_ID, "server-timing"],
    )
    app.state.gateway = gateway

    @app.middleware("http")
    async def headers_and_auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        request.state.request_id = request_id
        if settings.api_key and request.url.path.startswith("/v1") and not authorized(request, settings.api_key):
            response: Response = json_response(
                {"detail": "invalid or missing API key"}, 401, {"www-authenticate": "Bearer"}
            )
        else:
            response = await call_next(request)
        response.headers[REQUEST_ID] = request_id
        response.headers["server-timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
        return response

    def route(handler: Callable[[bytes, str], Awaitable[Response]]):
        async def endpoint(request: Request) -> Response:
            try:
                raw = decode_body(await request.body(), request.headers.get("content-encoding", ""))
                return await handler(raw, request.state.request_id)
            except RequestError as error:
                return json_response(error.body, error.status)
            except Overloaded as error:
                return overloaded(429, f"overloaded: {error}; retry later", settings.retry_after_s)
            except KevError as error:
                if error.kind == "invalid":  # Kev's context-overflow 422s come from the model
                    return json_response({"detail": error.message}, 422)
                if error.kind == "overloaded":
                    return overloaded(529, f"overloaded: {error.message}", settings.retry_after_s)
                if error.kind == "timeout":
                    return json_response({"detail": "the model did not answer in time"}, 504)
                return json_response({"detail": f"model error: {error.message}"}, 500)

        return endpoint

    app.post("/v1/systemone")(route(gateway.system_one))
    app.post("/v1/systemone/separate")(route(gateway.separate))
    app.post("/v1/systemone/permute")(route(gateway.permute))
    app.get("/v1/models")(gateway.models)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def authorized(request: Request, key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def overloaded(status: int, message: str, retry_after: int) -> Response:
    return json_response({"detail": message}, status, {"retry-after": str(retry_after)})


def main() -> None:
    parser = argparse.ArgumentParser(description="Kev System One gateway in front of Triton")
    parser.add_argument("--host", default=os.environ.get("GATEWAY_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GATEWAY_PORT", "8009")))
    parser.add_argument("--triton", help="Triton gRPC address (TRITON_GRPC_URL, default 127.0.0.1:8001)")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    if args.triton:
        os.environ["TRITON_GRPC_URL"] = args.triton
    import uvicorn

    uvicorn.run(
        "kev_backend.gateway:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
