"""Many utterances at once over few WebSockets, and the same in process: what the agent frameworks' services
(`tts.pipecat`, `tts.livekit`) speak through.

An agent host runs many conversations, each speaking one reply at a time, often into the next before the last has
played (an interruption cancels it). `ContextPool` opens each reply as a context (``context_id``) on a shared
WebSocket to ``tts serve`` (docs/protocol.md), up to ``contexts_per_connection`` on one socket (the server's
``--max-contexts``), and opens another socket only when every one is full: 64 sessions with
``--max-contexts 16`` use 4 connections. `LocalContexts` gives the same interface on this process's engine
(``LocalContexts(tts.api.get_engine())``). Either way a context is:

    context = await pool.open(voice="joe", lexicon={"Zorblax": "tomato"})
    await context.push("Hello there. ")          # text as it comes (an LLM's tokens)
    await context.end()                           # no more text: the rest is spoken
    async for event in context.events():          # {"type": "audio", "pcm": s16le bytes}, {"type": "words",
        ...                                       #  "words": [{"word", "start", "end"}]}, then {"type": "done"}
    await context.cancel()                        # stop at once: the server (or engine) frees its slot

A failure of the context alone raises `ServerError` (its code, e.g. ``bad_text``) from `events`; a connection
that drops fails its contexts with `ClientError` (pooled contexts are not resumed: an agent's reply is stale by
then) and the next `open` connects again.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
from collections.abc import AsyncIterator

import numpy as np
import websockets

from tts.client import ClientError, ServerError, stream_url
from tts.lexicon import Lexicon, LexiconError
from tts.text import TextError

REFUSED_HERE = ("too_many_contexts",)  # a start refused by this socket alone: another one may take it
_ids = itertools.count()


class SpeechContext:
    """One utterance: text in, audio and word timings out (`ContextPool.open`, `LocalContexts.open`)."""

    context_id: str
    finished: bool = False  # its done (or failure) came: nothing more to cancel
    sample_rate: int = 24_000  # the engine's (`tts.SAMPLE_RATE`); a context asked for another has its own

    async def push(self, text: str) -> None:
        raise NotImplementedError

    async def flush(self) -> None:
        raise NotImplementedError

    async def end(self) -> None:
        raise NotImplementedError

    async def cancel(self) -> None:
        raise NotImplementedError

    def events(self) -> AsyncIterator[dict]:
        raise NotImplementedError


class RemoteContext(SpeechContext):
    """A context on a pooled WebSocket; its events come from the socket's reader."""

    def __init__(self, connection: _Connection, context_id: str, sample_rate: int):
        self.connection, self.context_id, self.sample_rate = connection, context_id, sample_rate
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.refusable = True  # until its ready, an error alone ends it (a refused start: no done follows)

    async def _send(self, kind: str, **fields) -> None:
        if not self.finished:
            await self.connection.send({"type": kind, "context_id": self.context_id, **fields})

    async def push(self, text: str) -> None:
        if text:
            await self._send("text", text=text)

    async def flush(self) -> None:
        await self._send("flush")

    async def end(self) -> None:
        await self._send("end")

    async def cancel(self) -> None:
        """Stop at once; the server answers with ``done`` (cancelled), which frees this context's place."""
        with contextlib.suppress(ClientError, websockets.ConnectionClosed, OSError):
            await self._send("cancel")

    async def events(self) -> AsyncIterator[dict]:
        failure = None
        while not self.finished:
            event = await self.inbox.get()
            if isinstance(event, Exception):  # the connection is gone
                self.finished = True
                raise event
            kind = event["type"]
            if kind == "audio":
                yield {"type": "audio", "pcm": base64.b64decode(event["audio"])}
            elif kind == "timing" and event.get("words"):
                yield {"type": "words", "words": event["words"]}
            elif kind == "error":
                failure = ServerError(event.get("code", "unknown"), event.get("message", ""))
            elif kind == "done":
                self.finished = True
                if failure is not None:
                    raise failure
                yield event


class _Connection:
    """One WebSocket and its contexts; a reader task hands each event to its context."""

    def __init__(self, ws):
        self.ws, self.contexts = ws, {}
        self.closed = False
        self.full = False  # the server refused it another context (its --max-contexts is lower than ours)
        self.reader = asyncio.create_task(self._read())

    async def send(self, message: dict) -> None:
        if self.closed:
            raise ClientError("the connection to the server is closed")
        await self.ws.send(json.dumps(message))

    async def _read(self) -> None:
        failure: Exception = ClientError("the connection to the server closed")
        try:
            async for message in self.ws:
                if isinstance(message, bytes):
                    continue  # the default context's audio: this pool names every context
                event = json.loads(message)
                context = self.contexts.get(event.get("context_id"))
                if context is not None:
                    context.inbox.put_nowait(event)
                    if event["type"] == "done" or (event["type"] == "error" and context.refusable):
                        self.contexts.pop(context.context_id, None)
        except (websockets.ConnectionClosed, OSError) as err:
            failure = ClientError(f"the connection to the server dropped: {err}")
        finally:
            self.closed = True
            for context in self.contexts.values():
                context.inbox.put_nowait(failure)
            self.contexts.clear()

    async def close(self) -> None:
        self.closed = True
        await self.ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader


class ContextPool:
    """Contexts on shared WebSockets to one ``tts serve`` (module docstring). ``url``: ws://HOST:PORT (or http://);
    ``api_key`` (default $TTS_API_KEY); ``contexts_per_connection``: the server's ``--max-contexts`` (default 4);
    ``sample_rate``: of the audio asked for (16000, 22050, 24000 or 44100)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        contexts_per_connection: int = 4,
        sample_rate: int = 24_000,
        **connect_kwargs,
    ):
        self.url, self.sample_rate = stream_url(url), sample_rate
        self.contexts_per_connection = contexts_per_connection
        if api_key := api_key or os.environ.get("TTS_API_KEY"):
            connect_kwargs["additional_headers"] = {
                "Authorization": f"Bearer {api_key}",
                **connect_kwargs.get("additional_headers", {}),
            }
        self._connect_kwargs = connect_kwargs
        self._connections: list[_Connection] = []
        self._lock = asyncio.Lock()

    @classmethod
    def given(cls, pool: ContextPool | None, url: str | None, who: str, **options) -> tuple[ContextPool, bool]:
        """``pool``, or a new pool on ``url`` with ``options``; and whether it is new (its caller then closes it).
        Neither: ValueError naming ``who``, the service that needs one."""
        if pool is not None:
            return pool, False
        if url is None:
            raise ValueError(f"{who} needs the server's url (or a ContextPool)")
        return cls(url, **options), True

    @property
    def connections(self) -> int:
        return sum(not c.closed for c in self._connections)

    async def open(
        self,
        voice: str | None = None,
        speed: float = 1.0,
        *,
        lexicon: dict | None = None,
        seed: int | None = None,
        hold: bool = True,
        context_id: str | None = None,
    ) -> RemoteContext:
        """A started context (its ``ready`` received; while the server is full it waits in its queue). Raises
        ServerError for a refused start (unknown_voice, bad_value for a bad lexicon entry, server_full, ...)."""
        start = {"voice": voice, "speed": speed, "lexicon": lexicon, "seed": seed, "hold": None if hold else False}
        start = {
            "type": "start",
            "format": "pcm_s16le",
            "sample_rate": self.sample_rate,
            "word_timings": True,
            **{k: v for k, v in start.items() if v is not None},
        }
        context_id = context_id or f"c{next(_ids)}"
        for _ in range(8):  # a socket another client's contexts filled meanwhile: the next one
            connection = await self._connection()
            context = RemoteContext(connection, context_id, self.sample_rate)
            connection.contexts[context_id] = context
            await connection.send({**start, "context_id": context_id})
            while (
                (event := await context.inbox.get()) and not isinstance(event, Exception) and event["type"] == "queued"
            ):
                pass
            if isinstance(event, Exception):
                raise event
            if event["type"] == "ready":
                context.refusable = False
                return context
            connection.contexts.pop(context_id, None)
            if event.get("code") not in REFUSED_HERE:
                raise ServerError(event.get("code", "unknown"), event.get("message", ""))
            connection.full = True
        raise ClientError("no connection to the server took another context")

    async def _connection(self) -> _Connection:
        async with self._lock:
            self._connections = [c for c in self._connections if not c.closed]
            room = [c for c in self._connections if len(c.contexts) < self.contexts_per_connection and not c.full]
            if room:
                return min(room, key=lambda c: len(c.contexts))
            try:
                ws = await websockets.connect(self.url, max_size=None, **self._connect_kwargs)
            except (OSError, websockets.WebSocketException) as err:
                raise ClientError(f"cannot connect to {self.url}: {err}") from None
            connection = _Connection(ws)
            self._connections.append(connection)
            return connection

    async def aclose(self) -> None:
        connections, self._connections = self._connections, []
        await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)


class LocalContext(SpeechContext):
    """A context on this process's engine: an engine stream."""

    def __init__(self, stream, context_id: str):
        self.stream, self.context_id = stream, context_id
        self.sample_rate = stream.engine.sample_rate

    async def push(self, text: str) -> None:
        self._text(self.stream.push_text, text)

    async def flush(self) -> None:
        self._text(self.stream.flush)

    async def end(self) -> None:
        self._text(self.stream.end)

    def _text(self, call, *args) -> None:
        try:
            call(*args)
        except TextError as err:
            raise ServerError("bad_text", str(err)) from None

    async def cancel(self) -> None:
        """Stop at once: the engine frees the stream's slot at its next tick."""
        self.stream.cancel()

    async def events(self) -> AsyncIterator[dict]:
        try:
            while (chunk := await self.stream.next_chunk()) is not None:
                yield {"type": "audio", "pcm": pcm16(chunk)}
                if words := self.stream.take_word_timings():
                    yield {"type": "words", "words": words}
        except TextError as err:
            raise ServerError("bad_text", str(err)) from None
        except Exception as err:
            raise ServerError("engine_error", f"speech generation failed: {err}") from None
        if words := self.stream.take_word_timings():
            yield {"type": "words", "words": words}
        if not self.stream.cancelled:
            yield {"type": "done", "audio_seconds": self.stream.samples / self.sample_rate}


class LocalContexts:
    """`ContextPool`'s interface on an engine of this process (``tts.api.get_engine()``); ``wait_s``: how long an
    open waits for a free slot."""

    def __init__(self, engine, wait_s: float = 30.0):
        self.engine, self.wait_s = engine, wait_s
        self.sample_rate = engine.sample_rate

    async def open(
        self,
        voice: str | None = None,
        speed: float = 1.0,
        *,
        lexicon: dict | None = None,
        seed: int | None = None,
        hold: bool = True,
        context_id: str | None = None,
    ) -> LocalContext:
        try:
            said = Lexicon.of(lexicon)
        except LexiconError as err:
            raise ServerError("bad_value", str(err)) from None
        try:
            stream = await asyncio.to_thread(self.engine.open, voice, speed, seed=seed, wait_s=self.wait_s)
        except Exception as err:
            raise ServerError(getattr(err, "code", "bad_value"), str(err)) from None
        stream.text.lexicon = said
        if not hold:
            stream.text.hold_off()
        return LocalContext(stream, context_id or f"c{next(_ids)}")

    async def aclose(self) -> None:
        pass


def pcm16(audio: np.ndarray) -> bytes:
    """float32 [-1, 1] -> 16-bit little-endian PCM bytes, as the server's ``pcm_s16le``."""
    return np.round(np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()
