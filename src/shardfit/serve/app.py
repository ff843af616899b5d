"""The HTTP face on rank 0 (FastAPI): checks each request, queues a command, answers futures.

Every route is under /api/v1 as the SDK calls it; anything else is 404 -- never 5xx or
501, which the SDK retries for minutes. A request is checked here in full (JSON or protobuf schema, the model and
session it names, token ids against the vocabulary, paths inside the run directory) and refused with one line and
a 4xx before it becomes a command, so no rank ever sees it. Bodies over `max_body` bytes are refused (413) as they
arrive, before they are read whole; a key is required on every route (security.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from shardfit.errors import ShardfitError
from shardfit.serve import routes
from shardfit.serve.security import key_ok
from shardfit.serve.state import ServerState

PROTO = "application/x-protobuf"


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes, by its Content-Length or as its chunks arrive."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _too_large(send, self.limit)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _too_large(send, self.limit)


class _TooLarge(Exception):
    pass


async def _too_large(send, limit: int) -> None:
    body = json.dumps({"detail": f"the request body exceeds {limit} bytes; fix: send fewer datums per request "
                                 "(the SDK chunks forward_backward by fwdbwd_max_chunk_bytes_count)"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        state.futures.loop = asyncio.get_running_loop()  # where a finished command wakes its polls
        yield

    app = FastAPI(title="shardfit serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if not key_ok(state.api_key, request.headers.get("x-api-key")):
            return error(401, "missing or wrong X-API-Key; fix: pass api_key= (the key in the run directory's "
                              "api_key file when the server is not on loopback)")
        return await call_next(request)

    @app.exception_handler(ShardfitError)
    async def user_error(_request: Request, e: ShardfitError):
        return error(400, str(e))

    @app.exception_handler(ValidationError)
    async def bad_schema(_request: Request, e: ValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error(400, f"{where or 'body'}: {first.get('msg')}; fix: send the fields the tinker SDK sends")

    routes.add_routes(app, state)
    app.add_middleware(BodyLimit, limit=state.max_body)  # outermost: before authentication reads anything
    return app
