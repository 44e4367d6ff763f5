"""The ASGI app: routes (the HTTP API, the WebSocket, the demo's files), access and CORS middleware, and what
runs while it serves (trimming the C heap; ending waiting sessions at shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
from pathlib import Path

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from serving import http_api, workers
from serving.context import ServerContext, clients_of
from serving.limits import Limits
from serving.protocol import CLIENT_MESSAGE, ProtocolError, Resume
from serving.session import Session, error_message
from tts.lexicon import Lexicon

log = logging.getLogger("tts.server")
DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"
RESUME_GRACE_S = 5.0  # how long a connection over the caps has to say it resumes a waiting session
TRIM_EVERY_S = 60.0  # how often the C heap's free pages go back to the system (`_trim_heap`)


async def stream_endpoint(ws: WebSocket) -> None:
    hub: ServerContext = ws.app.state.hub
    clients = clients_of(ws.scope, hub)
    await ws.accept()
    step: tuple | None  # (the session, a resume or None)
    try:
        step = (Session(hub, clients, hub.admission.connect(clients)), None)
    except ProtocolError as err:
        step = await _resume_past_caps(ws, hub, err, clients)
    while step is not None:  # a resume moves the socket to the session it names
        session, resume = step
        try:
            step = await session.serve(ws, resume)
        except Exception:  # a bug must cost one connection, never the server
            log.exception("WebSocket session failed")
            await session.close()
            step = None


async def _resume_past_caps(ws: WebSocket, hub: ServerContext, refusal: ProtocolError, clients: tuple) -> tuple | None:
    """A connection over the connection caps may still resume a session that waits for it: that session's own
    place in the caps is what it takes (else a client whose every connection dropped at once could not come back,
    its waiting sessions filling its cap). Only as many such connections wait at once, for RESUME_GRACE_S at
    most, as its identity has sessions waiting (`Admission.resume_grace`); the others are refused at once.
    (session, resume) when its first message resumes one; else the refusal (or why the resume failed) is sent,
    the socket closed (1013: try again later), and None returned."""
    if (grace := hub.admission.resume_grace(clients)) is not None:
        try:
            with contextlib.suppress(TimeoutError, ValidationError, TypeError, KeyError):
                async with asyncio.timeout(RESUME_GRACE_S):
                    message = await ws.receive()
                if isinstance(msg := CLIENT_MESSAGE.validate_json(message["text"]), Resume):
                    try:
                        return Session.claim(hub, msg, clients)
                    except ProtocolError as err:
                        refusal = err
        finally:
            grace.release()
    with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected, OSError):
        await ws.send_text(json.dumps(error_message(refusal)))
        await ws.close(1013, refusal.code)
    return None


class _DemoRoute(Route):
    """The demo's static files, at every path outside the API: a Route, not a Mount, and never matching /v1/, so
    a wrong method on an API path gets that path's 405 (PUT /v1/audio/speech: Allow: POST), not the files' own."""

    def matches(self, scope):
        if scope["path"].startswith("/v1/"):
            return Match.NONE, {}
        return super().matches(scope)


def build_app(
    engine=None,
    limits: Limits | None = None,
    *,
    api_keys=(),
    allow_origins=(),
    aliases: dict[str, str] | None = None,
    load_engine=None,
    lexicon=None,
) -> Starlette:
    """The ASGI app. `engine=None`: ``load_engine()`` loads one on first use (`server.create_app`: the process-wide
    engine).
    `api_keys`: when given, every /v1 endpoint wants one. `allow_origins`: browser origins, besides the server's
    own, that may use the API and the WebSocket (and get CORS headers); "*" allows any. `aliases`: OpenAI voice
    names -> voices (default: voices/voices.json). `lexicon`: the server's pronunciations (`tts.lexicon`)."""
    hub = ServerContext(engine, limits or Limits(), aliases, tuple(api_keys), tuple(allow_origins), load_engine)
    hub.lexicon = Lexicon.of(lexicon)
    demo = StaticFiles(directory=DEMO_DIR, html=True)
    api = http_api
    routes = [
        Route("/health", api.health),
        Route("/v1/voices", api.voices),
        Route("/v1/audio/voices", api.audio_voices),
        Route("/v1/models", api.models),
        Route("/v1/audio/models", api.audio_models),
        Route("/v1/audio/speech", api.speech, methods=["POST"]),
        WebSocketRoute("/v1/stream", stream_endpoint),
        _DemoRoute("/{path:path}", demo, methods=["GET", "HEAD"]),
    ]
    middleware = [Middleware(api.AccessMiddleware, hub=hub)]
    if hub.allow_origins:
        middleware.insert(
            0,
            Middleware(
                CORSMiddleware,
                allow_origins=list(hub.allow_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type", "X-API-Key"],
                expose_headers=["X-Sample-Rate", "Retry-After"],
            ),
        )
    if (worker := workers.this_worker()) is not None:
        middleware.append(Middleware(_WorkerHeader, worker=worker))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=functools.partial(_lifespan, hub),
        exception_handlers={HTTPException: api.http_exception, Exception: api.server_error},
    )
    app.state.hub = hub
    return app


class _WorkerHeader:
    """In a pool of workers (`tts serve --workers N`) every HTTP response names the worker that answered,
    ``x-tts-worker: INDEX/COUNT``: its /health describes that worker alone (docs/scale-out.md)."""

    def __init__(self, app, worker: workers.Worker):
        self.app, self.header = app, (b"x-tts-worker", f"{worker.index}/{worker.count}".encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@contextlib.asynccontextmanager
async def _lifespan(hub: ServerContext, app: Starlette):
    """While serving, trim the C heap now and then (`_trim_heap`). At shutdown, end the sessions that wait for a
    resume (their engine streams would outlive the server), then close what the hub holds open."""
    trimming = asyncio.create_task(_trim_heap(TRIM_EVERY_S))
    yield
    trimming.cancel()
    for session in list(hub.sessions):
        await session.close()
    hub.shutdown()


async def _trim_heap(every_s: float) -> None:
    """Give the C heap's free pages back to the system every ``every_s`` (glibc's malloc_trim; elsewhere
    nothing). Many threads allocate and free audio buffers and tensors of every size, and glibc keeps what they
    free in its arenas: under the soak (`bench.soak`, loaded 2-core machine) untrimmed RSS crept up for good
    (+8.6 MB in 5 minutes); trimmed, it rose a few MB between trims and fell back (sampled every 20 s: 736 MiB
    after the first minute, 736 four minutes later, never above 742)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(trim, 0)
