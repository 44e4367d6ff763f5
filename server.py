"""The tts server: streams speech to many clients at once from one shared engine.

Endpoints (the WebSocket protocol is specified in docs/protocol.md):
  WS   /v1/stream          JSON control messages in, binary audio frames out, several utterances a connection
  POST /v1/audio/speech    OpenAI-compatible speech API; the body streams while the audio is generated
  GET  /v1/voices          the shipped voices
  GET  /health             liveness and load
  GET  /                   the browser demo (static files of demo/)

Starlette routes the requests and uvicorn serves them; uvicorn's WebSocket side is the `websockets`
package (its sans-I/O protocol, which waits for the socket to drain before each send: that wait is
the backpressure that stops a slow reader from making the server buffer audio without bound).
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from streaming.containers import MEDIA_TYPES, Encoder
from streaming.engine import EngineError, ServerFull, UnknownVoice
from streaming.protocol import (CLIENT_MESSAGE, Cancel, End, Flush, ProtocolError, SpeechRequest, Start, Text,
                                validation_error)
from tts import SAMPLE_RATE
from tts.text import TextError, text_to_sentences

log = logging.getLogger("tts.server")
DEMO_DIR = Path(__file__).resolve().parent / "demo"
POLL_S = 0.05  # how long one blocking engine read may wait; bounds how late a cancelled read notices
START_WAIT_S = 0.5  # how long a start may wait for a free engine slot
VOICE_KEYS = ("name", "description", "teacher", "license", "sample_rate", "default")


@dataclass(frozen=True)
class Limits:
    """Resource limits, all configurable through `serve(**limits)` and `tts serve`."""
    max_connections: int = 16       # open WebSockets plus speech requests in flight, together
    max_text_chars: int = 4096      # text of one utterance (OpenAI's own limit is 4096)
    idle_timeout_s: float = 30.0    # a WebSocket with no message and no audio sent for this long is closed
    send_buffer_bytes: int = 65536  # kernel send buffer of each connection; audio beyond it waits in the engine
    max_message_bytes: int = 65536  # largest client message or request body

    def __post_init__(self):
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"limit {name} must be positive, not {value!r}")


# ---- shared state -------------------------------------------------------------------------------
class Hub:
    """What every connection shares: the engine, the limits, the admission count and a thread pool for
    the engine's blocking calls (two per connection at most, so no connection waits for another's)."""

    def __init__(self, engine, limits: Limits):
        self.limits, self._engine = limits, engine
        self.pool = ThreadPoolExecutor(2 * limits.max_connections + 2, thread_name_prefix="tts-io")
        self.sessions: set[Session] = set()
        self.admitted = 0

    def admit(self) -> bool:
        if self.admitted >= self.limits.max_connections:
            return False
        self.admitted += 1
        return True

    def leave(self) -> None:
        self.admitted -= 1

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def engine(self):
        if self._engine is None:
            from tts.api import get_engine
            self._engine = await self.call(get_engine)
        return self._engine

    def check_length(self, chars: int, what: str) -> None:
        """text_too_long past max_text_chars, or past the engine's own limit if that is lower."""
        limit = min(self.limits.max_text_chars, getattr(self._engine, "max_chars", self.limits.max_text_chars))
        if chars > limit:
            raise ProtocolError("text_too_long", f"{what} {chars} characters; the limit is {limit}")

    async def open(self, voice: str | None, speed: float):
        """A new engine stream. When every slot is busy it waits up to START_WAIT_S for one (a cancelled
        stream's slot frees on the engine's next tick) before answering server_full."""
        engine = await self.engine()
        deadline = time.monotonic() + START_WAIT_S
        while True:
            try:
                return await self.call(engine.open, voice, speed)
            except ServerFull as err:
                if time.monotonic() > deadline:
                    raise ProtocolError(err.code, str(err)) from None
            except UnknownVoice as err:
                raise ProtocolError(err.code, str(err)) from None
            except ValueError as err:
                raise ProtocolError("bad_value", str(err)) from None
            await asyncio.sleep(0.02)

    async def chunks(self, stream):
        """The stream's audio chunks as they are decoded; a read waits in the pool, never in the event loop."""
        while True:
            try:
                chunk = await self.call(stream.read, POLL_S)
            except TimeoutError:
                continue
            except TextError as err:  # the utterance ended with nothing speakable in it
                raise ProtocolError("bad_text", str(err)) from None
            except EngineError as err:
                raise ProtocolError("engine_error", f"speech generation failed: {err}") from None
            if chunk is None:
                return
            yield chunk


# ---- WebSocket sessions -------------------------------------------------------------------------
class Session:
    """One WebSocket connection: a loop over client messages, and at most one audio pump at a time.
    States: idle -> (start) -> open -> (end) -> ending -> (all audio sent: done) -> idle."""

    def __init__(self, ws: WebSocket, hub: Hub):
        self.ws, self.hub, self.limits = ws, hub, hub.limits
        self.state, self.stream, self.pump = "idle", None, None
        self.last_active = time.monotonic()
        self.sent_bytes = 0

    async def run(self) -> None:
        while (message := await self._receive()) is not None:
            try:
                await self._handle(message)
            except ProtocolError as err:
                await self.send_error(err.code, err.message)

    async def close(self) -> None:
        await self._stop_pump()

    async def send_json(self, message: dict) -> None:
        """Send an event. A client that reads nothing for idle_timeout_s raises TimeoutError: it is dropped."""
        await asyncio.wait_for(self.ws.send_text(json.dumps(message)), self.limits.idle_timeout_s)

    async def send_error(self, code: str, message: str) -> None:
        await self.send_json({"type": "error", "code": code, "message": message})

    async def _receive(self) -> dict | None:
        """The next client message, or None when the client has gone or has been idle too long."""
        while True:
            wait = self.limits.idle_timeout_s - (time.monotonic() - self.last_active)
            if wait <= 0:
                await self._stop_pump()
                async with asyncio.timeout(1.0):  # a client that reads nothing gets no goodbye
                    await self.send_error("idle_timeout", f"no message and no audio for {self.limits.idle_timeout_s} s")
                    await self.ws.close(1000, "idle_timeout")
                return None
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout=wait)
            except asyncio.TimeoutError:
                continue  # audio may have been sent meanwhile: check again
            if message["type"] == "websocket.disconnect":
                return None
            self.last_active = time.monotonic()
            return message

    async def _handle(self, message: dict) -> None:
        if message.get("text") is None:
            raise ProtocolError("bad_message", "messages must be JSON text; binary messages are not accepted")
        try:
            parsed = CLIENT_MESSAGE.validate_json(message["text"])
        except ValidationError as err:
            raise validation_error(err) from None
        await getattr(self, f"_on_{parsed.type}")(parsed)

    def _require(self, state: str, what: str) -> None:
        if self.state != state:
            hint = "send start first" if self.state == "idle" else f"the utterance is {self.state}"
            raise ProtocolError("bad_state", f"{what} is not allowed now: {hint}")

    async def _on_start(self, msg: Start) -> None:
        if self.state != "idle":
            raise ProtocolError("bad_state", f"an utterance is {self.state}: end or cancel it and wait for done")
        self.stream = await self.hub.open(msg.voice, msg.speed)
        self.state, self.chars, self.first_text_at = "open", 0, None
        self.utterance_samples, self.first_audio_at = 0, None
        await self.send_json({"type": "ready", "sample_rate": SAMPLE_RATE, "format": msg.format,
                              "voice": self.stream.voice, "speed": msg.speed})
        self.pump = asyncio.create_task(self._pump(self.stream, Encoder(msg.format), msg.timings))

    async def _on_text(self, msg: Text) -> None:
        self._require("open", "text")
        self.hub.check_length(self.chars + len(msg.text), "this text would make the utterance")
        if msg.text.strip():
            self.first_text_at = self.first_text_at or time.perf_counter()
        try:
            self.stream.push_text(msg.text)  # thread-safe and cheap: the engine thread phonemises
        except TextError as err:
            raise ProtocolError("bad_text", str(err)) from None
        self.chars += len(msg.text)

    async def _on_flush(self, msg: Flush) -> None:
        self._require("open", "flush")
        self.stream.flush()

    async def _on_end(self, msg: End) -> None:
        self._require("open", "end")
        self.stream.end()
        self.state = "ending"

    async def _on_cancel(self, msg: Cancel) -> None:
        if self.pump is None:
            return  # nothing to cancel: the cancel crossed a done on the wire
        stream, sent = self.stream, self.utterance_samples
        await self._stop_pump()
        await self.send_json(self._done(stream, sent, cancelled=True))

    async def _stop_pump(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        if self.pump is not None:
            self.pump.cancel()
            await asyncio.gather(self.pump, return_exceptions=True)
        self.pump, self.stream, self.state = None, None, "idle"

    async def _pump(self, stream, encoder: Encoder, timings: bool = False) -> None:
        """Engine -> socket. Each send waits while the socket is backed up, and no read happens meanwhile,
        so the engine's queue fills and it pauses this stream's generation."""
        try:
            async for chunk in self.hub.chunks(stream):
                scheduled = stream.take_timings()  # phonemes are scheduled just ahead of their audio
                if timings and scheduled:
                    await self.send_json({"type": "timing", "phonemes": scheduled})
                await self._send_audio(encoder.encode(chunk), len(chunk))
            await self._send_audio(encoder.finish(), 0)
            await self.send_json(self._done(stream, self.utterance_samples, cancelled=False))
        except ProtocolError as err:  # nothing speakable, or the engine failed
            await self._fail(stream, err.code, err.message)
        except (WebSocketDisconnect, WebSocketDisconnected, OSError, TimeoutError):
            return  # the client has gone or stalled; the session ends it
        except Exception as err:  # a bug ends this utterance, not the connection
            log.exception("audio pump failed")
            await self._fail(stream, "internal", f"internal error: {err}")
        finally:
            encoder.close()
        self.pump, self.stream, self.state = None, None, "idle"

    async def _fail(self, stream, code: str, message: str) -> None:
        """Report a failure of the utterance, then end it with a done marked cancelled."""
        await self.send_error(code, message)
        await self.send_json(self._done(stream, self.utterance_samples, cancelled=True))

    async def _send_audio(self, data: bytes, samples: int) -> None:
        self.utterance_samples += samples  # an encoder may hold a chunk back, but it is in the utterance
        if not data:
            return
        await self.ws.send_bytes(data)
        self.sent_bytes += len(data)
        self.last_active = time.monotonic()
        self.first_audio_at = self.first_audio_at or time.perf_counter()

    def _done(self, stream, samples: int, cancelled: bool) -> dict:
        ttfa = None
        if self.first_text_at is not None and self.first_audio_at is not None:
            ttfa = round((self.first_audio_at - self.first_text_at) * 1000, 1)
        return {"type": "done", "cancelled": cancelled, "audio_seconds": round(samples / SAMPLE_RATE, 3),
                "ttfa_ms": ttfa, "rtf": stream.stats["rtf"], "engine_ttfa_ms": stream.stats["ttfa_ms"]}


async def stream_endpoint(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    await ws.accept()
    if not hub.admit():
        await ws.send_text(json.dumps({"type": "error", "code": "server_full", "message":
                                       f"the server has {hub.limits.max_connections} connections; try again shortly"}))
        await ws.close(1013, "server_full")
        return
    session = Session(ws, hub)
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
        hub.leave()


# ---- HTTP -----------------------------------------------------------------------------------------
_HTTP_STATUS = {"server_full": 503, "body_too_large": 413, "engine_error": 500}


def _http_error(err: ProtocolError) -> JSONResponse:
    return JSONResponse({"error": {"message": err.message, "type": "invalid_request_error", "code": err.code,
                                   "param": None}}, status_code=_HTTP_STATUS.get(err.code, 400))


async def _read_body(request: Request, limit: int) -> bytes:
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ProtocolError("body_too_large", f"the request body is over {limit} bytes")
    return body


class AudioResponse(StreamingResponse):
    """The speech body, streamed as it is generated; the engine slot is released however the response ends."""

    def __init__(self, hub: Hub, stream, fmt: str):
        self._hub, self._stream, self._encoder = hub, stream, Encoder(fmt)
        super().__init__(self._body(), media_type=MEDIA_TYPES[fmt], headers={"X-Sample-Rate": str(SAMPLE_RATE)})

    async def _body(self):
        try:
            async for chunk in self._hub.chunks(self._stream):
                if data := self._encoder.encode(chunk):
                    yield data
            if tail := self._encoder.finish():
                yield tail
        except ProtocolError as err:  # the status line is gone: end the body early and log why
            log.error("speech request failed mid-stream: %s", err.message)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._stream.cancel()
            self._encoder.close()
            self._hub.leave()


async def _speech_request(request: Request, hub: Hub) -> SpeechRequest:
    body = await _read_body(request, hub.limits.max_message_bytes)
    try:
        req = SpeechRequest.model_validate_json(body)
    except ValidationError as err:
        raise validation_error(err) from None
    hub.check_length(len(req.input), "input is")
    try:
        await hub.call(text_to_sentences, req.input)  # empty or unspeakable: an error now, not an empty body
    except TextError as err:
        raise ProtocolError("bad_text", str(err)) from None
    return req


async def _speech_stream(hub: Hub, req: SpeechRequest):
    """An engine stream with the whole input pushed, holding one admission (released by AudioResponse)."""
    if not hub.admit():
        raise ProtocolError("server_full", "the server is at its connection limit; try again shortly")
    stream = None
    try:
        stream = await hub.open(req.voice, req.speed)
        stream.push_text(req.input)
        stream.end()
        return stream
    except BaseException as err:
        hub.leave()
        if stream is not None:
            stream.cancel()
        if isinstance(err, TextError):
            raise ProtocolError("bad_text", str(err)) from None
        raise


async def speech(request: Request):
    hub: Hub = request.app.state.hub
    try:
        await hub.engine()
        req = await _speech_request(request, hub)
        stream = await _speech_stream(hub, req)
    except ProtocolError as err:
        return _http_error(err)
    return AudioResponse(hub, stream, req.response_format)


async def voices(request: Request) -> JSONResponse:
    engine = await request.app.state.hub.engine()
    listed = [{k: v.get(k) for k in VOICE_KEYS} for v in engine.voices.values()]
    return JSONResponse({"default": engine.default_voice, "sample_rate": SAMPLE_RATE, "voices": listed})


async def health(request: Request) -> JSONResponse:
    hub: Hub = request.app.state.hub
    return JSONResponse({"status": "ok", "sample_rate": SAMPLE_RATE, "connections": hub.admitted,
                         "max_connections": hub.limits.max_connections})


def create_app(engine=None, limits: Limits | None = None) -> Starlette:
    """The ASGI app. `engine=None` uses the process-wide engine on the shipped voices, loaded on first use."""
    hub = Hub(engine, limits or Limits())
    routes = [Route("/health", health), Route("/v1/voices", voices),
              Route("/v1/audio/speech", speech, methods=["POST"]), WebSocketRoute("/v1/stream", stream_endpoint),
              Mount("/", StaticFiles(directory=DEMO_DIR, html=True), name="demo")]
    app = Starlette(routes=routes)
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
          **limits) -> None:
    """Serve until interrupted. `limits` are the fields of `Limits` (max_connections=..., ...). The engine loads,
    and compiles its step unless ``compile`` is false (or TTS_NO_COMPILE=1), before the socket opens, so missing
    weights fail here and the first client waits for neither."""
    lim = Limits(**limits)
    if engine is None:
        from tts.api import get_engine
        engine = get_engine(compile=compile)
    sock = _bind(host, port, lim)
    _server(create_app(engine, lim), lim, log_level).run(sockets=[sock])


class ServerThread:
    """The real server in a background thread, on a free loopback port by default (tests, benchmarks).

    >>> with ServerThread(engine) as server:   # doctest: +SKIP
    ...     server.ws_url  # 'ws://127.0.0.1:PORT/v1/stream'
    """

    def __init__(self, engine=None, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **limits):
        self.limits = Limits(**limits)
        self.app = create_app(engine, self.limits)
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
