"""The HTTP side of the server: OpenAI's speech API (raw audio or SSE, streamed as it is generated), the model
and voice listings, /health, errors in OpenAI's shape, and the access checks (Origin, API key) in front of the
API and the WebSocket. docs/protocol.md specifies it."""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging

from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.admission import retry_after_header
from serving.context import ServerContext, api_key, clients_of, origin_allowed
from serving.protocol import ProtocolError, SpeechRequest, check_whole_text, validation_error
from tts.codec import CodecConfig
from tts.containers import MEDIA_TYPES, AudioEncoder
from tts.rates import SAMPLE_RATE
from tts.text import TextError

log = logging.getLogger("tts.server")
VOICE_KEYS = ("name", "description", "teacher", "license", "sample_rate", "default")
MODELS = ("tts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # listed for clients that pick one; all speak alike
FRAME_RATE = CodecConfig().frame_rate  # codec frames per second: the "output tokens" of an SSE done event's usage


class AccessMiddleware:
    """Refuses, before any endpoint runs: a foreign Origin on the API or the WebSocket (403 origin_not_allowed),
    and, when API keys are set, a missing or wrong key (401 invalid_api_key). A refused WebSocket upgrade gets
    HTTP 403, either way (uvicorn's empty answer to a close before accept: its answer to a custom HTTP response
    there logs a spurious error for every refusal). /health and the demo's static files are open."""

    def __init__(self, app, hub: ServerContext):
        self.app, self.hub = app, hub

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = None
        if not origin_allowed(headers.get("origin"), headers.get("host"), self.hub.allow_origins):
            refusal = ProtocolError(
                "origin_not_allowed",
                f"origin {headers.get('origin')!r} may not use this server; start it with --allow-origin to allow it",
            )
        elif self.hub.api_keys and not any(
            hmac.compare_digest((api_key(scope) or "").encode(), k.encode()) for k in self.hub.api_keys
        ):
            refusal = ProtocolError(
                "invalid_api_key",
                "a valid API key is required: Authorization: Bearer KEY "
                "(or X-API-Key: KEY; on the WebSocket also ?api_key=KEY)",
            )
        if refusal is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            log.info("WebSocket refused: %s", refusal.message)
            await receive()  # websocket.connect
            return await send({"type": "websocket.close", "code": 1008, "reason": refusal.code})
        extra = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else {}
        await error_response(refusal, extra)(scope, receive, send)


def error_response(err: ProtocolError, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error shape and status for a typed error; Retry-After on refusals a retry may get past."""
    return JSONResponse(err.openai(), status_code=err.status, headers={**retry_after_header(err), **(headers or {})})


async def http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_message")
    err = ProtocolError(code, f"{request.method} {request.url.path}: {exc.detail}")
    response = error_response(err, dict(exc.headers or {}))
    response.status_code = exc.status_code
    return response


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(ProtocolError("internal", "internal server error"))


async def _read_body(request: Request, limit: int) -> bytes:
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ProtocolError("body_too_large", f"the request body is over {limit} bytes")
    return body


async def _speech_request(request: Request, hub: ServerContext) -> SpeechRequest:
    """The validated request: JSON, voice, and its text (`tts.text.validate_text`: length, characters, something
    speakable). What the engine's text front end makes of the text is still known with the first audio, before
    the status line (`speech`)."""
    body = await _read_body(request, hub.limits.max_message_bytes)
    try:
        req = SpeechRequest.model_validate_json(body)
    except ValidationError as err:
        raise validation_error(err) from None
    req.voice = hub.resolve_voice(req.voice_name)
    hub.lexicon_for(req.lexicon)  # a bad entry is refused here, before the request is admitted
    hub.check_length(len(req.input), "input is", "input")
    check_whole_text(req.input, hub.text_limit, "input")  # before the engine or the queue: a 400, no audio
    return req


GONE = object()  # what `_until_disconnect` returns when the client has left


async def _until_disconnect(request: Request, awaitable):
    """``awaitable``'s result, or GONE should the client disconnect first (it is then cancelled: a queued
    request whose client has gone leaves the queue)."""
    task = asyncio.ensure_future(awaitable)
    gone = False

    async def watch():
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone and not asyncio.current_task().cancelling():
            return GONE
        raise
    finally:
        watcher.cancel()


class SpeechResponse(StreamingResponse):
    """The speech body, streamed as it is generated: raw audio, or OpenAI's SSE events. A failure after the
    status line is visible: SSE sends an error event; raw audio ends the chunked body without its terminating
    chunk, so the client reads an incomplete body rather than a short file. The slot and the connection are
    released however the response ends. ``chunks`` are the stream's (`ServerContext.chunks`), ``first`` the first
    of them, read before the status line."""

    def __init__(self, hub: ServerContext, req: SpeechRequest, ticket, stream, clients: tuple, chunks, first):
        self._hub, self._req, self._ticket, self._stream, self._clients = hub, req, ticket, stream, clients
        self._chunks, self._first = chunks, first
        self._encoder = AudioEncoder(
            "pcm_s16le" if req.response_format == "pcm" else req.response_format, req.sample_rate
        )
        self._failed = False
        sse = req.stream_format == "sse"
        media = "text/event-stream" if sse else MEDIA_TYPES[req.response_format]
        headers = {"X-Sample-Rate": str(self._encoder.rate)} | ({"Cache-Control": "no-cache"} if sse else {})
        super().__init__(self._sse() if sse else self._audio(), media_type=media, headers=headers)

    async def _encoded(self):
        chunk, samples = self._first, 0
        while chunk is not None:
            samples += len(chunk)
            self._hub.check_audio(samples, len(self._req.input))
            if data := self._encoder.encode(chunk):
                yield data
            chunk = await anext(self._chunks, None)
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
        chars, frames = len(self._req.input), round(self._stream.stats["audio_seconds"] * FRAME_RATE)
        yield event(
            {
                "type": "speech.audio.done",
                "usage": {"input_tokens": chars, "output_tokens": frames, "total_tokens": chars + frames},
            }
        )

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
            await self._chunks.aclose()
            self._hub.close(self._ticket, self._stream)
            self._encoder.close()
            self._hub.admission.disconnect(self._clients)


async def speech(request: Request):
    hub: ServerContext = request.app.state.hub
    clients = clients_of(request.scope, hub)
    try:
        await hub.engine()
        req = await _speech_request(request, hub)
        hub.admission.connect(clients)
    except ProtocolError as err:
        return error_response(err)
    except ClientDisconnect:  # the body was cut short: expected, one line (nobody reads an answer)
        log.info("speech request from %s: the client left before its body was read", clients[0][1])
        return Response(status_code=400)
    opened = chunks = first = None
    try:
        opened = await _until_disconnect(
            request, hub.open(clients, req.voice, req.speed, req.seed, lexicon=hub.lexicon_for(req.lexicon))
        )
        if opened is not GONE:
            opened[1].push_text(req.input)
            opened[1].end()
            chunks = hub.chunks(opened[1])
            # The status line waits for the first audio, so text the front end cannot speak is still a 400
            # (no second pass over the text to find out first: the first audio comes as soon as it can).
            first = await _until_disconnect(request, anext(chunks, None))
    except BaseException as err:
        await _abandon(hub, clients, opened, chunks)
        if isinstance(err, TextError):  # the engine's own text limit, if lower than ours
            err = ProtocolError("bad_text", str(err), "input")
        if isinstance(err, ProtocolError):
            err.param = err.param or ("input" if err.code == "bad_text" else None)
            return error_response(err)
        raise
    if opened is GONE or first is GONE:  # the client has left; nobody reads this answer
        await _abandon(hub, clients, opened, chunks)
        return Response(status_code=204)
    return SpeechResponse(hub, req, *opened, clients, chunks, first)


async def _abandon(hub: ServerContext, clients: tuple, opened, chunks) -> None:
    """Undo what `speech` had done when it cannot answer with audio."""
    if chunks is not None:
        await chunks.aclose()
    if opened is not None and opened is not GONE:
        hub.close(*opened)
    hub.admission.disconnect(clients)


async def voices(request: Request) -> JSONResponse:
    hub: ServerContext = request.app.state.hub
    engine = await hub.engine()
    listed = [{k: v.get(k) for k in VOICE_KEYS} for v in engine.voices.values()]
    return JSONResponse(
        {"default": engine.default_voice, "sample_rate": SAMPLE_RATE, "voices": listed, "aliases": hub.aliases}
    )


async def audio_voices(request: Request) -> JSONResponse:
    """{"voices": [{"id", "name", ...}]}: the voices, then the aliases, as Open WebUI reads them."""
    hub: ServerContext = request.app.state.hub
    engine = await hub.engine()
    own = [
        {
            "id": name,
            "name": name,
            "description": v.get("description"),
            "default": bool(v.get("default")),
            "alias_of": None,
        }
        for name, v in engine.voices.items()
    ]
    aliases = [
        {
            "id": alias,
            "name": alias,
            "description": f"OpenAI voice name for {voice}",
            "default": False,
            "alias_of": voice,
        }
        for alias, voice in hub.aliases.items()
    ]
    return JSONResponse({"voices": own + aliases})


async def models(request: Request) -> JSONResponse:
    return JSONResponse(
        {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "tts"} for m in MODELS]}
    )


async def audio_models(request: Request) -> JSONResponse:
    return JSONResponse({"models": [{"id": m} for m in MODELS]})


async def health(request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.hub.stats())
