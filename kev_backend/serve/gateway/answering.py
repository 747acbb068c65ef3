"""The pieces of the gateway's answers: /permute's envelope and its option orders, /separate's and /permute's
truncation marks, the request's routing key, the Triton calls of one request cancelled together, and a request
abandoned when its client goes away."""

from __future__ import annotations

import asyncio
import json
import random
import traceback
from collections.abc import Awaitable
from typing import Any

from fastapi import Request, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.types import Receive

from ...protocol.request import Limits, Record, RequestError, load_body, parse_request, state_key
from .bodies import client_gone


class PermuteBody(BaseModel):
    """/permute's envelope. Its integers are strict, as JSON integers: "6", 6.0 or true are 422s, not coerced."""

    request: dict[str, Any]
    question: str
    n_perm: int = Field(6, ge=1, le=64, strict=True)
    seed: int = Field(0, strict=True)


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, unless the client goes away first: then `work` is cancelled, and with it every Triton call
    it awaits, and the request is refused as client_disconnected.

    Only call it once the body is read: the next ASGI message is then `http.disconnect`, so waiting on `receive`
    notices the client leaving at once, without polling."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request.receive))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this request is itself cancelled (shutdown): nothing is left running
        watcher.cancel()
        task.cancel()
    if task in done:
        return task.result()
    await asyncio.wait((task,))  # let the cancelled work unwind: its admission slot is released in a `finally`
    if not task.cancelled():
        task.exception()  # whatever it ended with (it may have finished meanwhile), nobody is left to tell
    raise client_gone()


async def disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def nested(error: RequestError, *prefix: str) -> RequestError:
    """A request validated inside an envelope (`/permute`'s `request`): its error locations under that field."""
    if isinstance(error.detail, str):
        return error
    detail = [{**e, "loc": ["body", *prefix, *e["loc"][1:]]} for e in error.detail]
    return RequestError(detail, error.status)


def truncation_marks(reply: dict[str, Any]) -> tuple[dict[str, int], bool] | None:
    """A reply's truncation marks, which a server that truncates states puts on every response (usage.state_tokens,
    usage.state_tokens_used, truncated); None from a server that does not. /separate and /permute carry them as Kev's
    server does."""
    if "truncated" not in reply:
        return None
    usage = reply["usage"]
    return {"state_tokens": usage["state_tokens"], "state_tokens_used": usage["state_tokens_used"]}, reply["truncated"]


def parsed_and_keyed(body: bytes | dict[str, Any], limits: Limits) -> tuple[Record, str]:
    """The request's record and its state's routing key."""
    record = parse_request(body, limits)
    return record, state_key(record.state_text)


def permute_envelope(raw: bytes, limits: Limits) -> PermuteBody:
    """/permute's body, read as FastAPI reads a body (a BOM, UTF-16 and UTF-32 as Starlette decodes them) and
    validated with FastAPI's error shapes."""
    data = load_body(raw, limits)
    try:
        return PermuteBody.model_validate(data)
    except ValidationError as error:
        detail = [{**e, "loc": ["body", *e["loc"]]} for e in error.errors(include_url=False)]
        raise RequestError(json.loads(json.dumps(detail, default=lambda _: {}))) from None


def permutations(keys: list[str], n_perm: int, seed: int) -> list[list[str]]:
    """The option orders /permute scores: the request's own first, then n_perm - 1 shuffles (seeded)."""
    rng = random.Random(seed)
    orders = [keys]
    for _ in range(n_perm - 1):
        order = list(keys)
        rng.shuffle(order)
        orders.append(order)
    return orders


def grouped(sizes: list[int], room: int, most: int) -> list[range]:
    """Consecutive groups of items whose sizes sum to at most `room`, at most `most` items each (at least one item
    each, whatever its size: the model then refuses it by name)."""
    groups, start, used = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and (used + size > room or i - start >= most):
            groups.append(range(start, i))
            start, used = i, 0
        used += size
    groups.append(range(start, len(sizes)))
    return groups


def forget(error: BaseException) -> None:
    """Drops what a handled exception's traceback holds: its frames' locals (a request's body, its parsed record, the
    gRPC message) would otherwise stay in a reference cycle (exception, traceback, frame, the task that raised it)
    until the garbage collector happens to run, megabytes a large request."""
    traceback.clear_frames(error.__traceback__)
    error.__traceback__ = None


async def gather_or_cancel(calls: list[Awaitable[Any]]) -> list[Any]:
    """All of `calls`' results; when one fails the others are cancelled (and with them their Triton calls) before the
    failure is raised, so none runs on after the request's admission ends."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
