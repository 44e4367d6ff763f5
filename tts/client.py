"""A Python client for the tts server's WebSocket protocol (docs/protocol.md).

    async with connect("ws://127.0.0.1:8000") as client:
        async for chunk in client.speak("Hello there.", voice="joe"):
            ...                       # float32 mono chunks at 24 kHz, as they are generated
        client.done                   # {"type": "done", "audio_seconds": ..., "ttfa_ms": ..., "rtf": ...}

`text` may also be an iterable or async iterable of pieces (an LLM's tokens): each piece is sent as it
comes. `synthesize_via_server` is the blocking form, and `say_via_server` (used by
`tts say "..." --server ws://host:port`) writes a sound file atomically or plays through a sound device.
A server started with API keys wants one: `connect(url, api_key=...)` (default: the TTS_API_KEY variable).
A connection that drops mid-utterance is resumed on a new one (`connect(..., resume=False)` to fail instead):
the audio goes on where it stopped, nothing lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import soundfile as sf
import websockets

from tts.output import PlaybackError, open_device
from tts.rates import SAMPLE_RATE

FILE_FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "ogg": ("OGG", "VORBIS")}
TextSource = str | Iterable[str] | AsyncIterable[str]


class ClientError(RuntimeError):
    """The client could not do what was asked (no server there, no sound device, ...)."""


class ServerError(ClientError):
    """The server answered {"type": "error", "code": ..., "message": ...}."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def stream_url(url: str) -> str:
    """ws://host:port or http://host:port[/v1/stream] -> the WebSocket endpoint's URL."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.netloc:
        raise ClientError(f"not a server URL: {url!r} (expected ws://HOST:PORT)")
    path = parts.path if parts.path not in ("", "/") else "/v1/stream"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


async def _pieces(text: TextSource) -> AsyncIterator[str]:
    if isinstance(text, str):
        yield text
    elif isinstance(text, AsyncIterable):
        async for piece in text:
            yield piece
    else:
        for piece in text:
            yield piece


ACK_BYTES = 16_384  # acknowledge audio this often: the server keeps what is unacknowledged for a resume
RETRY_CODES = ("server_full", "client_limit")  # a refused reconnection: try again after the back-off


class StreamClient:
    """One session on /v1/stream; utterances are spoken one after another on it (the server also takes
    several at once, by context_id: see docs/protocol.md; this client keeps to one).

    A connection that drops (no close from the server) is resumed: the client reconnects, `retries` times at
    most with a back-off from `backoff_s` doubling, and the server sends what did not arrive while the client
    sends again what the server did not get, so the caller sees one uninterrupted stream (`reconnects` counts
    them). `reopen` opens a new connection (None: no resuming)."""

    def __init__(self, ws, reopen=None, retries: int = 5, backoff_s: float = 0.1):
        self.ws, self._reopen, self.retries, self.backoff_s = ws, reopen, retries, backoff_s
        self.ready: dict | None = None
        self.done: dict | None = None
        self.queue_position: int | None = None  # while the server is full: the place of our start in its queue
        self.timings: list[dict] = []  # the utterance's timing events, when asked for
        self.resume_token: str | None = None
        self.reconnects = 0
        self._lock = asyncio.Lock()  # one utterance at a time on a connection
        self._send_lock = asyncio.Lock()  # a resume's resending and new messages keep their order
        self._got_bytes = self._got_events = self._acked_bytes = 0  # received over the session
        self._outbox: list[str] = []  # sent since the last done: the server may not have had them
        self._outbox_base = 0  # messages sent before _outbox[0] (acks and resumes are not counted)

    async def _send(self, message: dict) -> None:
        """Send a message, kept until the utterance's done to be sent again should a resume need it."""
        text = json.dumps(message)
        async with self._send_lock:
            self._outbox.append(text)
            with contextlib.suppress(websockets.ConnectionClosed, OSError):
                await self.ws.send(text)  # on a dropped connection, the receiving side resumes

    async def _recv(self) -> str | bytes:
        """The next message; a connection that dropped is resumed first."""
        while True:
            try:
                message = await self.ws.recv()
            except websockets.ConnectionClosed as closed:
                if closed.rcvd is not None or self.resume_token is None or self._reopen is None:
                    raise  # the server closed it, or it cannot be resumed
                await self._resume()
                continue
            if isinstance(message, bytes):
                self._got_bytes += len(message)
                if self._got_bytes - self._acked_bytes >= ACK_BYTES:
                    await self._ack()
            return message

    async def _next_event(self) -> dict | bytes:
        message = await self._recv()
        if isinstance(message, bytes):
            return message
        event = json.loads(message)
        kind = event.get("type")
        self._got_events += kind not in ("queued", "resumed")
        if kind == "error":
            raise ServerError(event.get("code", "unknown"), event.get("message", ""))
        if kind == "ready":
            self.resume_token = event.get("resume_token", self.resume_token)
        elif kind == "done":  # the server has had every message of the utterance
            self._outbox_base += len(self._outbox)
            self._outbox = []
        return event

    async def _ack(self) -> None:
        self._acked_bytes = self._got_bytes
        with contextlib.suppress(websockets.ConnectionClosed, OSError):
            await self.ws.send(json.dumps({"type": "ack", "bytes": self._got_bytes, "events": self._got_events}))

    async def _resume(self) -> None:
        """Reconnect and resume the session. Raises ServerError when the server cannot resume it (the session
        expired, ...), ClientError when no try got through."""
        failure = None
        for attempt in range(self.retries):
            await asyncio.sleep(self.backoff_s * 2**attempt)
            try:
                ws = await self._reopen()
                await ws.send(
                    json.dumps(
                        {
                            "type": "resume",
                            "token": self.resume_token,
                            "contexts": [{"bytes": self._got_bytes, "events": self._got_events}],
                        }
                    )
                )
                async with asyncio.timeout(10):
                    answer = json.loads(await ws.recv())
            except (OSError, TimeoutError, ClientError, websockets.WebSocketException) as err:
                failure = err
                continue
            if answer.get("type") == "error":
                await ws.close()
                failure = ServerError(answer.get("code", "unknown"), answer.get("message", ""))
                if failure.code in RETRY_CODES:
                    continue
                break
            self.resume_token = answer["resume_token"]
            async with self._send_lock:
                self.ws = ws
                for text in self._outbox[answer["received"] - self._outbox_base :]:
                    await ws.send(text)
            self.reconnects += 1
            return
        self.resume_token = None  # the session is lost: no more tries
        if isinstance(failure, ServerError):
            raise failure
        raise ClientError(f"the connection to the server dropped and {self.retries} tries to resume failed: {failure}")

    async def _start(self, voice: str | None, speed: float, fmt: str, **options) -> None:
        start = {"type": "start", "voice": voice, "format": fmt, "speed": speed}
        await self._send(start | {k: v for k, v in options.items() if v is not None})
        self.timings, self.done = [], None
        while isinstance(event := await self._next_event(), dict) and event.get("type") == "queued":
            self.queue_position = event["position"]  # every slot is busy: the server holds our place
        if not isinstance(event, dict) or event.get("type") != "ready":
            raise ClientError(f"expected ready, got {event!r:.200}")
        self.ready, self.queue_position = event, None

    async def _send_text(self, text: TextSource) -> None:
        async for piece in _pieces(text):
            await self._send({"type": "text", "text": piece})
        await self._send({"type": "end"})

    async def stream(
        self,
        text: TextSource,
        voice: str | None = None,
        speed: float = 1.0,
        fmt: str = "pcm_s16le",
        *,
        seed: int | None = None,
        sample_rate: int | None = None,
        timings: bool = False,
        word_timings: bool = False,
        lexicon: dict[str, str] | None = None,
    ) -> AsyncIterator[bytes]:
        """The utterance's binary frames in `fmt` (at `sample_rate`, default 24 kHz), as they arrive. `seed`: the
        same seed and request give the same audio. `timings` / `word_timings`: the server's timing events (phonemes
        / words, in seconds) gather in `self.timings`. `lexicon`: ``{"word": "/IPA/" or "respelling"}`` for this
        utterance (`tts.lexicon`). Leaving the loop early cancels the utterance: at once inside
        `contextlib.aclosing(...)`, else when the generator is dropped (the next utterance on this connection
        waits for that)."""
        async with self._lock:
            await self._start(
                voice,
                speed,
                fmt,
                seed=seed,
                sample_rate=sample_rate,
                timings=timings or None,
                word_timings=word_timings or None,
                lexicon=lexicon or None,
            )
            sender = asyncio.create_task(self._send_text(text))
            try:
                while True:
                    event = await self._next_event()
                    if isinstance(event, bytes):
                        yield event
                    elif event.get("type") == "timing":
                        self.timings.append(event)
                    elif event.get("type") == "done":
                        self.done = event
                        break
                await sender
            finally:
                if not sender.done():
                    sender.cancel()
                    await asyncio.gather(sender, return_exceptions=True)
                if self.done is None:
                    await self._cancel()

    async def _cancel(self) -> None:
        """Cancel the utterance and skip what is still in flight, up to its done."""
        with contextlib.suppress(OSError, websockets.ConnectionClosed, TimeoutError, ClientError):
            await self._send({"type": "cancel"})
            async with asyncio.timeout(10):
                while True:
                    if isinstance(event := await self._next_event(), dict) and event.get("type") == "done":
                        self.done = event
                        return

    async def speak(
        self, text: TextSource, voice: str | None = None, speed: float = 1.0, **options
    ) -> AsyncIterator[np.ndarray]:
        """float32 mono chunks at 24 kHz (or `sample_rate=`), as they are generated; `options` as for `stream`."""
        async with contextlib.aclosing(self.stream(text, voice, speed, fmt="f32le", **options)) as frames:
            async for frame in frames:
                yield np.frombuffer(frame, dtype="<f4")

    async def close(self) -> None:
        await self.ws.close()


@contextlib.asynccontextmanager
async def connect(
    url: str, api_key: str | None = None, *, resume: bool = True, retries: int = 5, backoff_s: float = 0.1, **kwargs
) -> AsyncIterator[StreamClient]:
    """An open StreamClient; `api_key` (default: $TTS_API_KEY) for a server that wants one; `resume`: reconnect
    and resume after a dropped connection (`retries` tries, back-off from `backoff_s` doubling); `kwargs` go to
    `websockets.connect`."""
    target = stream_url(url)
    if api_key := api_key or os.environ.get("TTS_API_KEY"):
        kwargs["additional_headers"] = {"Authorization": f"Bearer {api_key}", **kwargs.get("additional_headers", {})}
    client = StreamClient(
        await _open(target, kwargs), functools.partial(_open, target, kwargs) if resume else None, retries, backoff_s
    )
    try:
        yield client
    finally:
        await client.ws.close()


async def _open(target: str, kwargs: dict):
    try:
        return await websockets.connect(target, **kwargs)
    except websockets.InvalidStatus as err:
        status = err.response.status_code
        hint = " (a wrong or missing API key: api_key=, or TTS_API_KEY; or an origin it does not allow)"
        raise ClientError(
            f"the tts server at {target} refused the connection: HTTP {status}{hint if status == 403 else ''}"
        ) from None
    except (OSError, websockets.InvalidHandshake, websockets.InvalidURI) as err:
        raise ClientError(f"cannot reach the tts server at {target}: {err}") from None


async def synthesize_async(
    url: str,
    text: TextSource,
    voice: str | None = None,
    speed: float = 1.0,
    seed: int | None = None,
    api_key: str | None = None,
) -> np.ndarray:
    async with connect(url, api_key) as client:
        chunks = [chunk async for chunk in client.speak(text, voice, speed, seed=seed)]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


def synthesize_via_server(
    url: str,
    text: TextSource,
    voice: str | None = None,
    speed: float = 1.0,
    seed: int | None = None,
    api_key: str | None = None,
) -> np.ndarray:
    """The whole utterance from a running server, as one float32 array at 24 kHz (blocking)."""
    return asyncio.run(synthesize_async(url, text, voice, speed, seed, api_key))


async def _to_file(client: StreamClient, text, voice, speed, out: Path, fmt: str) -> None:
    """Write chunks to a temporary file beside `out` as they arrive, then rename it into place."""
    container, subtype = FILE_FORMATS[fmt]
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    os.close(fd)
    try:
        with sf.SoundFile(tmp, "w", SAMPLE_RATE, 1, subtype, format=container) as sink:
            async for chunk in client.speak(text, voice, speed):
                sink.write(chunk)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _output_stream():
    try:
        return open_device(SAMPLE_RATE, instead="tts say TEXT --server URL -o out.wav")
    except PlaybackError as err:
        raise ClientError(str(err)) from None


async def _to_device(client: StreamClient, text, voice, speed, device) -> None:
    with device:
        async for chunk in client.speak(text, voice, speed):
            await asyncio.to_thread(device.write, chunk[:, None])


def say_via_server(
    url: str,
    text: TextSource,
    voice: str | None = None,
    out: str | os.PathLike | None = None,
    speed: float = 1.0,
    fmt: str = "wav",
    api_key: str | None = None,
) -> dict:
    """Speak `text` through a running server into the file `out` (24 kHz mono, `fmt` wav, flac or ogg;
    written atomically), or through a sound device when `out` is None. Returns the server's done event.
    Raises ServerError for what the server refused and ClientError for everything else."""
    if fmt not in FILE_FORMATS:
        raise ClientError(f"unsupported file format {fmt!r}; choose one of {sorted(FILE_FORMATS)}")
    device = _output_stream() if out is None else None

    async def run() -> dict:
        async with connect(url, api_key) as client:
            if device is not None:
                await _to_device(client, text, voice, speed, device)
            else:
                await _to_file(client, text, voice, speed, Path(out), fmt)
            return client.done

    return asyncio.run(run())
