"""The tts server: streams speech to many clients at once from one shared engine.

Endpoints (the WebSocket protocol and the HTTP API are specified in docs/protocol.md):
  WS   /v1/stream          JSON control messages in, audio out; several utterances (contexts) on one socket
  POST /v1/audio/speech    OpenAI-compatible speech API; the body (raw audio or SSE) streams as it is generated
  GET  /v1/models          OpenAI's model list;  GET /v1/audio/models  the same in Open WebUI's shape
  GET  /v1/voices          the shipped voices and their OpenAI aliases
  GET  /v1/audio/voices    the same in the shape Open WebUI and Kokoro-FastAPI clients read
  GET  /health             liveness, load and the engine's live figures
  GET  /                   the browser demo (static files of demo/)

Starlette routes the requests and uvicorn serves them; uvicorn's WebSocket side is the `websockets`
package (its sans-I/O protocol, which waits for the socket to drain before each send: that wait is
the backpressure that stops a slow reader from making the server buffer audio without bound).
Admission (connection caps, the FIFO queue for engine slots, per-client caps) is `streaming.admission`.
"""
from __future__ import annotations

import asyncio
import base64
import functools
import hmac
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Match, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from streaming.admission import Admission, Limits, retry_after_header
from streaming.containers import MEDIA_TYPES, Encoder
from streaming.engine import EngineError, ServerFull, UnknownVoice
from streaming.protocol import (CLIENT_MESSAGE, Cancel, End, Flush, ProtocolError, SpeechRequest, Start, Text,
                                check_text, validation_error)
from tts import SAMPLE_RATE
from tts.text import TextError, text_to_sentences

__all__ = ["Limits", "ServerThread", "create_app", "serve"]
log = logging.getLogger("tts.server")
DEMO_DIR = Path(__file__).resolve().parent / "demo"
POLL_S = 0.05  # how long one blocking engine read may wait; bounds how late a cancelled read notices
VOICE_KEYS = ("name", "description", "teacher", "sample_rate", "default")
MODELS = ("tts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # listed for clients that pick one; all speak alike
FRAME_RATE = 50  # codec frames per second: the "output tokens" of an SSE done event's usage


# ---- shared state -------------------------------------------------------------------------------
class Hub:
    """What every connection shares: the engine, the limits, admission, the voice aliases, the API keys and
    a thread pool for the engine's blocking calls (so no connection waits for another's)."""

    def __init__(self, engine, limits: Limits, aliases: dict[str, str] | None = None,
                 api_keys: tuple[str, ...] = (), allow_origins: tuple[str, ...] = ()):
        self.limits, self._engine, self._aliases = limits, engine, aliases
        self.api_keys, self.allow_origins = tuple(api_keys), tuple(allow_origins)
        self.admission = Admission(limits, slots=None if engine is None else engine.max_streams)
        self.pool = ThreadPoolExecutor(2 * limits.max_connections + 2, thread_name_prefix="tts-io")
        self.sessions: set[Session] = set()
        self.streams: set = set()  # engine streams open for clients, WebSocket and HTTP

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def engine(self):
        if self._engine is None:
            from tts.api import get_engine
            self._engine = await self.call(get_engine)
            self.admission.slots = self._engine.max_streams
        return self._engine

    @property
    def aliases(self) -> dict[str, str]:
        """OpenAI voice name -> one of the engine's voices (voices/voices.json "aliases"; those whose voice
        the engine has)."""
        if self._aliases is None:
            from tts.voices import voice_aliases
            self._aliases = voice_aliases()
        return {alias: voice for alias, voice in self._aliases.items() if voice in self._engine.voices}

    def resolve_voice(self, name: str | None, param: str = "voice") -> str | None:
        """A voice name or OpenAI alias -> the engine's voice; None -> None (the default voice).
        Example: "alloy" -> "joe"; "" -> unknown_voice (an empty name is a mistake, not the default)."""
        if name is None or name in self._engine.voices:
            return name
        if (voice := self.aliases.get(name.lower())) is not None:
            return voice
        raise ProtocolError("unknown_voice", f"unknown voice {name!r}; choose one of {sorted(self._engine.voices)} "
                            f"or an alias {sorted(self.aliases)}", param)

    def check_length(self, chars: int, what: str, param: str = "text") -> None:
        """text_too_long past max_text_chars, or past the engine's own limit if that is lower."""
        limit = min(self.limits.max_text_chars, getattr(self._engine, "max_chars", self.limits.max_text_chars))
        if chars > limit:
            raise ProtocolError("text_too_long", f"{what} {chars} characters; the limit is {limit}", param)

    async def open(self, clients: tuple, voice: str | None, speed: float, seed: int | None, on_queued=None):
        """(ticket, engine stream): a slot from admission (waiting in its queue if need be), then the stream.
        The caller hands both back to `close`."""
        engine = await self.engine()
        ticket = await self.admission.stream(clients, on_queued)
        try:
            stream = await self._open_stream(engine, voice, speed, seed)
        except BaseException:
            ticket.release()
            raise
        self.streams.add(stream)
        return ticket, stream

    def close(self, ticket, stream) -> None:
        """End an opened stream (a no-op once it has finished; else its engine slot frees) and free its slot
        in admission."""
        stream.cancel()
        self.streams.discard(stream)
        ticket.release()

    async def _open_stream(self, engine, voice, speed, seed):
        # Admission has granted a slot; the engine's own FIFO wait covers the tick until a just-ended
        # stream's slot is free, and other users of the engine in this process.
        opening = asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(
            engine.open, voice, speed, seed=seed, wait_s=self.limits.queue_timeout_s))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:  # the client left while the engine was opening: end what it opens
            opening.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().cancel())
            raise
        except ServerFull as err:
            raise ProtocolError(err.code, str(err), retry_after=self.admission.retry_after_s) from None
        except UnknownVoice as err:
            raise ProtocolError(err.code, str(err), "voice") from None
        except ValueError as err:
            raise ProtocolError("bad_value", str(err)) from None

    async def chunks(self, stream):
        """The stream's audio chunks as they are decoded; a read waits in the pool, never in the event loop.
        A failure of this stream alone (its text, or the engine) raises ProtocolError."""
        while True:
            try:
                chunk = await self.call(stream.read, POLL_S)
            except TimeoutError:
                continue
            except TextError as err:  # nothing speakable, or text the front end refused
                raise ProtocolError("bad_text", str(err)) from None
            except Exception as err:  # EngineError, or whatever else the engine attributed to this stream
                raise ProtocolError("engine_error", f"speech generation failed: {err}") from None
            if chunk is None:
                return
            yield chunk

    def stats(self) -> dict:
        figures = {"status": "ok", "sample_rate": SAMPLE_RATE, **self.admission.stats(),
                   "max_connections": self.limits.max_connections, "max_queue": self.limits.max_queue}
        if self._engine is not None:
            figures["slots"] = self._engine.max_streams
            if callable(stats := getattr(self._engine, "stats", None)):
                figures["engine"] = stats()
        return figures


# ---- access: API keys, origins, client identity ---------------------------------------------------
def _api_key(scope) -> str | None:
    """The key a request presents: `Authorization: Bearer KEY`, `X-API-Key: KEY`, or on a WebSocket (browsers
    cannot set its headers) the query parameter `api_key`."""
    headers = Headers(scope=scope)
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if key := headers.get("x-api-key"):
        return key
    if scope["type"] == "websocket":
        return (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key") or [None])[0]
    return None


def clients_of(scope, hub: Hub) -> tuple:
    """The identities one connection counts against: its remote address, and its API key when keys are set."""
    address = (scope.get("client") or ("unknown",))[0]
    key = _api_key(scope) if hub.api_keys else None
    return (("addr", address),) + ((("key", key),) if key else ())


def _origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """No Origin (SDKs, CLIs), the server's own origin, or one on the allow-list ("*": any). "null" (a sandboxed
    page or a file) is refused unless listed. Example: Host 127.0.0.1:8000 allows http://127.0.0.1:8000."""
    if origin is None or origin in allowed or "*" in allowed:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host.lower()


class AccessMiddleware:
    """Refuses, before any endpoint runs: a foreign Origin on the API or the WebSocket (403 origin_not_allowed),
    and, when API keys are set, a missing or wrong key (401 invalid_api_key). A refused WebSocket gets the HTTP
    answer instead of the upgrade. /health and the demo's static files are open."""

    def __init__(self, app, hub: Hub):
        self.app, self.hub = app, hub

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = None
        if not _origin_allowed(headers.get("origin"), headers.get("host"), self.hub.allow_origins):
            refusal = ProtocolError("origin_not_allowed", f"origin {headers.get('origin')!r} may not use this "
                                    "server; start it with --allow-origin to allow it")
        elif self.hub.api_keys and not any(hmac.compare_digest((_api_key(scope) or "").encode(), k.encode())
                                           for k in self.hub.api_keys):
            refusal = ProtocolError("invalid_api_key", "a valid API key is required: Authorization: Bearer KEY "
                                    "(or X-API-Key: KEY; on the WebSocket also ?api_key=KEY)")
        if refusal is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await receive()  # websocket.connect; the answer below replaces the upgrade
        extra = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else {}
        await error_response(refusal, extra)(scope, receive, send)


# ---- WebSocket sessions -------------------------------------------------------------------------
class Session:
    """One WebSocket connection: a loop over client messages and up to max_contexts utterances, each with
    its own audio pump. Messages name their utterance by context_id (none: the default one)."""

    def __init__(self, ws: WebSocket, hub: Hub, clients: tuple):
        self.ws, self.hub, self.limits, self.clients = ws, hub, hub.limits, clients
        self.utterances: dict[str | None, Utterance] = {}
        self.last_active = time.monotonic()
        self.sent_bytes = 0

    @property
    def stream(self):
        """The default utterance's engine stream, if any (tests watch it)."""
        utterance = self.utterances.get(None)
        return utterance.stream if utterance else None

    async def run(self) -> None:
        while (message := await self._receive()) is not None:
            try:
                await self._handle(message)
            except ProtocolError as err:
                await self.send_error(err, getattr(err, "context_id", None))

    async def close(self) -> None:
        for utterance in list(self.utterances.values()):
            await utterance.stop()

    async def send_json(self, message: dict) -> None:
        """Send an event. A client that reads nothing for idle_timeout_s raises TimeoutError: it is dropped."""
        await asyncio.wait_for(self.ws.send_text(json.dumps(message)), self.limits.idle_timeout_s)

    async def send_event(self, event: dict, context_id: str | None) -> None:
        await self.send_json(event if context_id is None else {**event, "context_id": context_id})

    async def send_error(self, err: ProtocolError, context_id: str | None = None) -> None:
        await self.send_event({"type": "error", "code": err.code, "message": err.message}, context_id)

    async def send_audio(self, data: bytes, context_id: str | None) -> None:
        """Audio of the default utterance goes as binary frames; of a named context, as JSON with base64
        (a binary frame cannot say which utterance it belongs to)."""
        if context_id is None:
            await asyncio.wait_for(self.ws.send_bytes(data), self.limits.idle_timeout_s)
        else:
            await self.send_json({"type": "audio", "context_id": context_id,
                                  "audio": base64.b64encode(data).decode("ascii")})
        self.sent_bytes += len(data)
        self.last_active = time.monotonic()

    async def _receive(self) -> dict | None:
        """The next client message, or None when the client has gone or has been idle too long. Idle means no
        text received and no audio sent; other messages do not count, and waiting in the queue is not idle."""
        while True:
            wait = self.limits.idle_timeout_s - (time.monotonic() - self.last_active)
            if wait <= 0 and any(u.state == "queued" for u in self.utterances.values()):
                self.last_active, wait = time.monotonic(), self.limits.idle_timeout_s
            if wait <= 0:
                await self.close()
                async with asyncio.timeout(1.0):  # a client that reads nothing gets no goodbye
                    await self.send_error(ProtocolError(
                        "idle_timeout", f"no text and no audio for {self.limits.idle_timeout_s:g} s"))
                    await self.ws.close(1000, "idle_timeout")
                return None
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout=wait)
            except asyncio.TimeoutError:
                continue  # audio may have been sent meanwhile: check again
            if message["type"] == "websocket.disconnect":
                return None
            return message

    async def _handle(self, message: dict) -> None:
        if message.get("text") is None:
            raise ProtocolError("bad_message", "messages must be JSON text; binary messages are not accepted")
        try:
            parsed = CLIENT_MESSAGE.validate_json(message["text"])
        except ValidationError as err:
            raise validation_error(err) from None
        try:
            await getattr(self, f"_on_{parsed.type}")(parsed)
        except ProtocolError as err:
            err.context_id = parsed.context_id  # the error belongs to the utterance the message named
            raise

    def _utterance(self, context_id: str | None, what: str) -> "Utterance":
        utterance = self.utterances.get(context_id)
        if utterance is None:
            raise ProtocolError("bad_state", f"{what} is not allowed now: send start first")
        if utterance.state == "ending":
            raise ProtocolError("bad_state", f"{what} is not allowed now: the utterance is ending")
        return utterance

    async def _on_start(self, msg: Start) -> None:
        if (current := self.utterances.get(msg.context_id)) is not None:
            raise ProtocolError("bad_state", f"an utterance is {current.state} here: end or cancel it and wait "
                                "for done, or use another context_id")
        if len(self.utterances) >= self.limits.max_contexts:
            raise ProtocolError("too_many_contexts", f"{len(self.utterances)} utterances are open on this socket, "
                                f"the most one may have; end one first")
        await self.hub.engine()
        voice = self.hub.resolve_voice(msg.voice)
        self.utterances[msg.context_id] = Utterance(self, msg, voice)

    async def _on_text(self, msg: Text) -> None:
        utterance = self._utterance(msg.context_id, "text")
        check_text(msg.text)
        self.hub.check_length(utterance.chars + len(msg.text), "this text would make the utterance")
        if msg.text.strip():
            self.last_active = time.monotonic()  # text is activity; an empty piece is not
        utterance.push("text", msg.text)

    async def _on_flush(self, msg: Flush) -> None:
        self._utterance(msg.context_id, "flush").push("flush")

    async def _on_end(self, msg: End) -> None:
        self._utterance(msg.context_id, "end").push("end")

    async def _on_cancel(self, msg: Cancel) -> None:
        utterance = self.utterances.get(msg.context_id)
        if utterance is not None:  # none: the cancel crossed a done on the wire
            await utterance.cancel()


class Utterance:
    """One utterance on a socket: queued (waiting for a slot; its text is kept) -> open -> ending (end received)
    -> gone. It ends with exactly one `done`, or, refused before `ready`, with one `error` alone. Only its own
    task sends those, so a cancel never cuts one in half: a cancel ends the wait or the engine stream, and the
    task then says `done`."""

    def __init__(self, session: Session, start: Start, voice: str | None):
        self.session, self.start, self.voice, self.context_id = session, start, voice, start.context_id
        self.state, self.stream, self.pending = "queued", None, []
        self.chars, self.samples, self.cancelled = 0, 0, False
        self.first_text_at = self.first_audio_at = None
        self.encoder = Encoder(start.format, start.sample_rate)
        self.opening = asyncio.ensure_future(session.hub.open(session.clients, voice, start.speed, start.seed,
                                                              self._queued))
        self.task = asyncio.create_task(self._run())

    def push(self, kind: str, text: str = "") -> None:
        """text / flush / end: to the engine stream, or kept until the stream opens."""
        if kind == "text":
            self.chars += len(text)
            if text.strip():
                self.first_text_at = self.first_text_at or time.perf_counter()
        elif kind == "end":
            self.state = "ending"
        if self.stream is None:
            self.pending.append((kind, text))
        else:
            self._apply(kind, text)

    def _apply(self, kind: str, text: str) -> None:
        try:
            {"text": lambda: self.stream.push_text(text), "flush": self.stream.flush, "end": self.stream.end}[kind]()
        except TextError as err:
            raise ProtocolError("bad_text", str(err), "text") from None

    async def cancel(self) -> None:
        """Stop at once: the wait in the queue ends, or generation stops and queued audio is dropped; then
        `done` with cancelled true. Returns once the utterance is gone."""
        self.cancelled = True
        if self.stream is not None:
            self.stream.cancel()
        else:
            self.opening.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def stop(self) -> None:
        """The connection is going: end everything, say nothing."""
        if self.stream is not None:
            self.stream.cancel()
        self.opening.cancel()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self._close_opened()  # should the task have been cancelled before it took the stream
        self.encoder.close()

    def _close_opened(self) -> None:
        opening = self.opening
        if opening.done() and not opening.cancelled() and opening.exception() is None:
            self.session.hub.close(*opening.result())  # idempotent

    async def _run(self) -> None:
        try:
            try:
                _, self.stream = await self.opening
            except asyncio.CancelledError:
                if not self.cancelled or asyncio.current_task().cancelling():
                    raise  # the connection is going
                return await self._finish()  # cancelled while queued
            if self.cancelled:
                return await self._finish()
            if self.state == "queued":
                self.state = "open"
            for kind, text in self.pending:
                self._apply(kind, text)
            self.pending = []
            seed = {} if self.start.seed is None else {"seed": self.start.seed}
            await self._event({"type": "ready", "sample_rate": self.encoder.rate, "format": self.start.format,
                               "voice": self.stream.voice, "speed": self.start.speed, **seed})
            await self._pump()
        except ProtocolError as err:
            if self.stream is None:  # refused before ready: no utterance was opened
                self._leave()
                await self.session.send_error(err, self.context_id)
            else:  # nothing speakable, or the engine failed
                await self.session.send_error(err, self.context_id)
                await self._finish(failed=True)
        except (WebSocketDisconnect, WebSocketDisconnected, OSError, TimeoutError):
            pass  # the client has gone or stalled; the session ends
        except Exception as err:  # a bug ends this utterance, not the connection
            log.exception("utterance failed")
            await self.session.send_error(ProtocolError("internal", f"internal error: {err}"), self.context_id)
            await self._finish(failed=True)
        finally:
            self._leave()
            self._close_opened()
            self.encoder.close()

    async def _queued(self, position: int) -> None:
        await self._event({"type": "queued", "position": position})

    async def _pump(self) -> None:
        """Engine -> socket. Each send waits while the socket is backed up, and no read happens meanwhile,
        so the engine's queue fills and it pauses this stream's generation."""
        stream, start = self.stream, self.start
        async for chunk in self.session.hub.chunks(stream):
            timing = {}
            if start.timings and (phonemes := stream.take_timings()):
                timing["phonemes"] = phonemes  # scheduled just ahead of their audio
            if start.word_timings and (words := stream.take_word_timings()):
                timing["words"] = words
            if timing:
                await self._event({"type": "timing", **timing})
            await self._send_audio(self.encoder.encode(chunk), len(chunk))
        if not self.cancelled:
            await self._send_audio(self.encoder.finish(), 0)
        await self._finish()

    async def _send_audio(self, data: bytes, samples: int) -> None:
        self.samples += samples  # an encoder may hold a chunk back, but it is in the utterance
        if data:
            await self.session.send_audio(data, self.context_id)
            self.first_audio_at = self.first_audio_at or time.perf_counter()

    async def _event(self, event: dict) -> None:
        await self.session.send_event(event, self.context_id)

    def _leave(self) -> None:
        """Free the context for the next start (before the last event goes, so a client answering it is served)."""
        if self.session.utterances.get(self.context_id) is self:
            del self.session.utterances[self.context_id]

    async def _finish(self, failed: bool = False) -> None:
        """The utterance's one `done`."""
        self._leave()
        ttfa = None
        if self.first_text_at is not None and self.first_audio_at is not None:
            ttfa = round((self.first_audio_at - self.first_text_at) * 1000, 1)
        stats = self.stream.stats if self.stream is not None else {"rtf": None, "ttfa_ms": None}
        await self._event({"type": "done", "cancelled": self.cancelled or failed,
                           "audio_seconds": round(self.samples / SAMPLE_RATE, 3), "ttfa_ms": ttfa,
                           "rtf": stats["rtf"], "engine_ttfa_ms": stats["ttfa_ms"]})


async def stream_endpoint(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    clients = clients_of(ws.scope, hub)
    await ws.accept()
    try:
        hub.admission.connect(clients)
    except ProtocolError as err:
        await ws.send_text(json.dumps({"type": "error", "code": err.code, "message": err.message}))
        await ws.close(1013, err.code)  # 1013: try again later
        return
    session = Session(ws, hub, clients)
    hub.sessions.add(session)
    try:
        await session.run()
    except (WebSocketDisconnect, WebSocketDisconnected, OSError, TimeoutError):
        pass  # gone, or stalled past the idle timeout
    except Exception:  # a bug must cost one connection, never the server
        log.exception("WebSocket session failed")
    finally:
        await session.close()
        hub.sessions.discard(session)
        hub.admission.disconnect(clients)


# ---- HTTP -----------------------------------------------------------------------------------------
def error_response(err: ProtocolError, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error shape and status for a typed error; Retry-After on refusals a retry may get past."""
    return JSONResponse(err.openai(), status_code=err.status, headers={**retry_after_header(err), **(headers or {})})


async def _http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_message")
    err = ProtocolError(code, f"{request.method} {request.url.path}: {exc.detail}")
    response = error_response(err, dict(exc.headers or {}))
    response.status_code = exc.status_code
    return response


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(ProtocolError("internal", "internal server error"))


async def _read_body(request: Request, limit: int) -> bytes:
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ProtocolError("body_too_large", f"the request body is over {limit} bytes")
    return body


async def _speech_request(request: Request, hub: Hub) -> SpeechRequest:
    """The validated request: JSON, voice, text characters and length, and the whole text through the front end
    (empty or unspeakable text is a 400 now, not an empty 200)."""
    body = await _read_body(request, hub.limits.max_message_bytes)
    try:
        req = SpeechRequest.model_validate_json(body)
    except ValidationError as err:
        raise validation_error(err) from None
    req.voice = hub.resolve_voice(req.voice_name)
    check_text(req.input, "input")
    hub.check_length(len(req.input), "input is", "input")
    try:
        await hub.call(text_to_sentences, req.input)
    except TextError as err:
        raise ProtocolError("bad_text", str(err), "input") from None
    except Exception as err:  # the front end must only raise TextError; whatever else it does is this text's fault
        log.exception("the text front end failed on a request's input")
        raise ProtocolError("bad_text", f"this input cannot be read aloud ({type(err).__name__})", "input") from None
    return req


async def _until_disconnect(request: Request, awaitable):
    """``awaitable``'s result, or CancelledError should the client disconnect first (a queued request whose
    client has gone leaves the queue)."""
    task = asyncio.ensure_future(awaitable)

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()


class SpeechResponse(StreamingResponse):
    """The speech body, streamed as it is generated: raw audio, or OpenAI's SSE events. A failure after the
    status line is visible: SSE sends an error event; raw audio ends the chunked body without its terminating
    chunk, so the client reads an incomplete body rather than a short file. The slot and the connection are
    released however the response ends."""

    def __init__(self, hub: Hub, req: SpeechRequest, ticket, stream, clients: tuple):
        self._hub, self._req, self._ticket, self._stream, self._clients = hub, req, ticket, stream, clients
        self._encoder = Encoder("pcm_s16le" if req.response_format == "pcm" else req.response_format,
                                req.sample_rate)
        self._failed = False
        sse = req.stream_format == "sse"
        media = "text/event-stream" if sse else MEDIA_TYPES[req.response_format]
        headers = {"X-Sample-Rate": str(self._encoder.rate)} | ({"Cache-Control": "no-cache"} if sse else {})
        super().__init__(self._sse() if sse else self._audio(), media_type=media, headers=headers)

    async def _encoded(self):
        async for chunk in self._hub.chunks(self._stream):
            if data := self._encoder.encode(chunk):
                yield data
        if tail := self._encoder.finish():
            yield tail

    async def _audio(self):
        try:
            async for data in self._encoded():
                yield data
        except ProtocolError as err:
            log.error("speech request failed mid-stream (%s): %s", err.code, err.message)
            self._failed = True

    async def _sse(self):
        def event(payload: dict) -> bytes:
            return f"data: {json.dumps(payload)}\n\n".encode()

        try:
            async for data in self._encoded():
                yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        except ProtocolError as err:
            log.error("speech request failed mid-stream (%s): %s", err.code, err.message)
            yield event({"type": "error", **err.openai()})
            return
        frames = round(self._stream.stats["audio_seconds"] * FRAME_RATE)
        yield event({"type": "speech.audio.done", "usage": {
            "input_tokens": len(self._req.input), "output_tokens": frames, "total_tokens": len(self._req.input) + frames}})

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for data in self.body_iterator:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        if not self._failed:  # else: returning without the last chunk makes the server abort the body
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._hub.close(self._ticket, self._stream)
            self._encoder.close()
            self._hub.admission.disconnect(self._clients)


async def speech(request: Request):
    hub: Hub = request.app.state.hub
    clients = clients_of(request.scope, hub)
    try:
        await hub.engine()
        req = await _speech_request(request, hub)
        hub.admission.connect(clients)
    except ProtocolError as err:
        return error_response(err)
    opened = None
    try:
        opened = await _until_disconnect(request, hub.open(clients, req.voice, req.speed, req.seed))
        opened[1].push_text(req.input)
        opened[1].end()
    except BaseException as err:
        hub.admission.disconnect(clients)
        if opened is not None:
            hub.close(*opened)
        if isinstance(err, ProtocolError):
            return error_response(err)
        if isinstance(err, TextError):  # pre-validated, so only an engine limit below ours
            return error_response(ProtocolError("bad_text", str(err), "input"))
        raise
    return SpeechResponse(hub, req, *opened, clients)


async def voices(request: Request) -> JSONResponse:
    hub: Hub = request.app.state.hub
    engine = await hub.engine()
    listed = [{k: v.get(k) for k in VOICE_KEYS} for v in engine.voices.values()]
    return JSONResponse({"default": engine.default_voice, "sample_rate": SAMPLE_RATE, "voices": listed,
                         "aliases": hub.aliases})


async def audio_voices(request: Request) -> JSONResponse:
    """{"voices": [{"id", "name", ...}]}: the voices, then the aliases, as Open WebUI reads them."""
    hub: Hub = request.app.state.hub
    engine = await hub.engine()
    own = [{"id": name, "name": name, "description": v.get("description"), "default": bool(v.get("default")),
            "alias_of": None} for name, v in engine.voices.items()]
    aliases = [{"id": alias, "name": alias, "description": f"OpenAI voice name for {voice}", "default": False,
                "alias_of": voice} for alias, voice in hub.aliases.items()]
    return JSONResponse({"voices": own + aliases})


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "tts"}
                                                    for m in MODELS]})


async def audio_models(request: Request) -> JSONResponse:
    return JSONResponse({"models": [{"id": m} for m in MODELS]})


async def health(request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.hub.stats())


class _DemoRoute(Route):
    """The demo's static files, at every path outside the API: a Route, not a Mount, and never matching /v1/, so
    a wrong method on an API path gets that path's 405 (PUT /v1/audio/speech: Allow: POST), not the files' own."""

    def matches(self, scope):
        if scope["path"].startswith("/v1/"):
            return Match.NONE, {}
        return super().matches(scope)


def create_app(engine=None, limits: Limits | None = None, *, api_keys=(), allow_origins=(),
               aliases: dict[str, str] | None = None) -> Starlette:
    """The ASGI app. `engine=None` uses the process-wide engine on the shipped voices, loaded on first use.
    `api_keys`: when given, every /v1 endpoint wants one. `allow_origins`: browser origins, besides the server's
    own, that may use the API and the WebSocket (and get CORS headers); "*" allows any. `aliases`: OpenAI voice
    names -> voices (default: voices/voices.json)."""
    hub = Hub(engine, limits or Limits(), aliases, tuple(api_keys), tuple(allow_origins))
    demo = StaticFiles(directory=DEMO_DIR, html=True)
    routes = [Route("/health", health), Route("/v1/voices", voices), Route("/v1/audio/voices", audio_voices),
              Route("/v1/models", models), Route("/v1/audio/models", audio_models),
              Route("/v1/audio/speech", speech, methods=["POST"]), WebSocketRoute("/v1/stream", stream_endpoint),
              _DemoRoute("/{path:path}", demo, methods=["GET", "HEAD"])]
    middleware = [Middleware(AccessMiddleware, hub=hub)]
    if hub.allow_origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(hub.allow_origins),
                                        allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type",
                                                                                      "X-API-Key"],
                                        expose_headers=["X-Sample-Rate", "Retry-After"]))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: _http_exception, Exception: _server_error})
    app.state.hub = hub
    return app


# ---- running it -----------------------------------------------------------------------------------
def _bind(host: str, port: int, limits: Limits) -> socket.socket:
    """A listening socket; accepted connections inherit its send buffer size."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
    sock.bind((host, port))
    return sock


def _server(app: Starlette, limits: Limits, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(app, ws="websockets-sansio", ws_max_size=limits.max_message_bytes,
                            log_level=log_level, timeout_graceful_shutdown=2)
    return uvicorn.Server(config)


def serve(host: str = "127.0.0.1", port: int = 8000, engine=None, log_level: str = "info", compile: bool = True,
          api_keys=(), allow_origins=(), **limits) -> None:
    """Serve until interrupted. `limits` are the fields of `Limits` (max_connections=..., ...); `api_keys` and
    `allow_origins` as in `create_app`. The engine loads, and compiles its step unless ``compile`` is false (or
    TTS_NO_COMPILE=1), before the socket opens, so missing weights fail here and the first client waits for neither."""
    lim = Limits(**limits)
    if engine is None:
        from tts.api import get_engine
        engine = get_engine(compile=compile)
    sock = _bind(host, port, lim)
    app = create_app(engine, lim, api_keys=api_keys, allow_origins=allow_origins)
    _server(app, lim, log_level).run(sockets=[sock])


class ServerThread:
    """The real server in a background thread, on a free loopback port by default (tests, benchmarks).

    >>> with ServerThread(engine) as server:   # doctest: +SKIP
    ...     server.ws_url  # 'ws://127.0.0.1:PORT/v1/stream'
    """

    def __init__(self, engine=None, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 api_keys=(), allow_origins=(), aliases: dict[str, str] | None = None, **limits):
        self.limits = Limits(**limits)
        self.app = create_app(engine, self.limits, api_keys=api_keys, allow_origins=allow_origins, aliases=aliases)
        self._sock = _bind(host, port, self.limits)
        self.host, self.port = self._sock.getsockname()[:2]
        self._server = _server(self.app, self.limits, log_level)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="tts-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}/v1/stream"

    @property
    def hub(self) -> Hub:
        return self.app.state.hub

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.hub.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
