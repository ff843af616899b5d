"""The HTTP face on rank 0 (FastAPI): checks each request, queues a command, answers futures.

Every route is under /api/v1 as the SDK calls it; anything else is 404 -- never 5xx or 501, which the SDK retries
for minutes. A request is checked here in full (JSON or protobuf schema, the model and session it names, token ids
against the vocabulary, paths inside the run directory) and refused with one line and a 4xx before it becomes a
command, so no rank ever sees it. No input answers 5xx:
- a body is read whole before any route sees it and refused (413) past `max_body` bytes, declared or chunked;
- every answer is encoded by SafeJSON: ASCII (a string that is not valid Unicode, echoed from a request, is escaped,
  never an encoding error) and non-finite numbers as the strings "Infinity" / "-Infinity" / "NaN", which the SDK's
  float fields read back (a skipped step's infinite gradient norm);
- an exception no check foresaw is a 400 that says it is the server's fault (uvicorn logs its traceback; counted in
  the state's `bugs`): a 5xx would only make the SDK retry the same request for minutes.
A key is required on every route (security.py); its digest is the request's principal (request.state.principal).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from shardfit.errors import ShardfitError
from shardfit.serve import listings, routes
from shardfit.serve.security import key_ok, principal
from shardfit.serve.state import ServerState

PROTO = "application/x-protobuf"


def json_safe(value):
    """`value` with every non-finite float as the string JSON and the SDK's pydantic floats both read."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class SafeJSON(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(json_safe(content), ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error(status: int, message: str) -> SafeJSON:
    return SafeJSON({"detail": message}, status_code=status)


class BodyLimit:
    """ASGI middleware: the body read whole before the app runs, 413 past `limit` bytes (by its Content-Length, or
    as its chunks arrive), and nothing run for a client that left mid-body."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _too_large(send, self.limit)
        parts, seen = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was whole: nothing is queued from it
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.limit:
                return await _too_large(send, self.limit)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(parts), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


async def _too_large(send, limit: int) -> None:
    body = json.dumps({"detail": f"the request body exceeds {limit} bytes; fix: send fewer datums per request "
                                 "(the SDK chunks forward_backward by fwdbwd_max_chunk_bytes_count)"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        state.futures.loop = asyncio.get_running_loop()  # where a finished command wakes its polls
        yield

    app = FastAPI(title="shardfit serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan,
                  default_response_class=SafeJSON)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        sent = request.headers.get("x-api-key")
        if not key_ok(state.api_key, sent):
            return error(401, "missing or wrong X-API-Key; fix: pass api_key= (the key in the run directory's "
                              "api_key file when the server is not on loopback)")
        request.state.principal = principal(sent)
        return await call_next(request)

    @app.exception_handler(ShardfitError)
    async def user_error(_request: Request, e: ShardfitError):
        return error(400, str(e))

    @app.exception_handler(ValidationError)
    async def bad_schema(_request: Request, e: ValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
        where = ".".join(str(p)[:40] for p in first.get("loc", ()))
        return error(400, f"{where or 'body'}: {first.get('msg')}; fix: send the fields the tinker SDK sends")

    @app.exception_handler(Exception)
    async def unforeseen(request: Request, e: Exception):
        state.bugs += 1  # its traceback: uvicorn logs it (Starlette re-raises after this answer)
        said = (str(e).strip().splitlines() or [""])[0][:200]
        return error(400, f"{request.url.path}: the server failed on this request ({type(e).__name__}: {said}), a "
                          "server bug logged with its traceback; fix: report it with the server's log (the request "
                          "was not run)")

    routes.add_routes(app, state)
    listings.add_listing_routes(app, state)  # the REST listings: answered from the state and the run directory
    app.add_middleware(BodyLimit, limit=state.max_body)  # outermost: before authentication reads anything
    return app
