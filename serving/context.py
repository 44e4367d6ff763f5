"""What every connection of the server shares: the engine, the limits and admission, the voice aliases, the API
keys, and a thread pool for the engine's blocking calls (opening a stream; audio is awaited without a thread,
`ServerContext.chunks`); and who a connection is (its address, its API key). serving/session.py (the WebSocket) and
serving/http_api.py (HTTP) use it; it serves no endpoint itself."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs, urlsplit

from starlette.datastructures import Headers

from serving.admission import Admission
from serving.limits import Limits
from serving.protocol import ProtocolError
from serving.resume import SpentTokens
from serving.workers import relayed_address
from streaming.engine import ServerFull, UnknownVoice
from tts.lexicon import Lexicon, LexiconError
from tts.rates import SAMPLE_RATE
from tts.text import TextError


class ServerContext:
    """What every connection shares: the engine, the limits, admission, the voice aliases, the API keys and
    a thread pool for the engine's blocking calls (so no connection waits for another's)."""

    def __init__(
        self,
        engine,
        limits: Limits,
        aliases: dict[str, str] | None = None,
        api_keys: tuple[str, ...] = (),
        allow_origins: tuple[str, ...] = (),
        load_engine=None,
    ):
        self.limits, self._engine, self._aliases = limits, engine, aliases
        self._load_engine = load_engine  # engine None: loads it on first use (the entry point's `tts.api.get_engine`)
        self.api_keys, self.allow_origins = tuple(api_keys), tuple(allow_origins)
        self.admission = Admission(limits, slots=None if engine is None else _open_streams(engine))
        self.pool = ThreadPoolExecutor(2 * limits.max_connections + 2, thread_name_prefix="tts-io")
        self.sessions: set = set()  # the WebSocket sessions (serving.session.Session), those waiting for a resume too
        self.resume_tokens: dict = {}  # resume token -> its session, or None once spent (resume_used)
        self.spent_tokens = SpentTokens()  # tokens spent by resumes of sessions that have ended (resume_used)
        self.streams: set = set()  # engine streams open for clients, WebSocket and HTTP
        self.lexicon = Lexicon()  # the server's (`tts serve --lexicon`); a request's entries win over it
        path = os.environ.get("TTS_TIMELINE_LOG")
        self.timeline_log = None if not path else TimelineLog(path)

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def engine(self):
        if self._engine is None:
            if self._load_engine is None:
                raise RuntimeError("no engine: pass one, or load_engine (server.create_app passes tts.api.get_engine)")
            self._engine = await self.call(self._load_engine)
            self.admission.slots = _open_streams(self._engine)
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
        raise ProtocolError(
            "unknown_voice",
            f"unknown voice {name!r}; choose one of {sorted(self._engine.voices)} or an alias {sorted(self.aliases)}",
            param,
        )

    @property
    def text_limit(self) -> int:
        """Characters of one utterance: max_text_chars, or the engine's own limit if that is lower."""
        return min(self.limits.max_text_chars, getattr(self._engine, "max_chars", self.limits.max_text_chars))

    def lexicon_for(self, entries: dict[str, str] | None) -> Lexicon:
        """The server's lexicon with a request's entries; bad_value naming a bad entry."""
        try:
            return self.lexicon.merged(entries)
        except LexiconError as err:
            raise ProtocolError("bad_value", str(err), "lexicon") from None

    def check_length(self, chars: int, what: str, param: str = "text") -> None:
        """text_too_long past `text_limit`."""
        if chars > (limit := self.text_limit):
            raise ProtocolError("text_too_long", f"{what} {chars} characters; the limit is {limit}", param)

    def check_audio(self, samples: int, chars: int) -> None:
        """audio_too_long once an utterance of ``chars`` characters would pass `Limits.audio_cap_s` with
        ``samples`` (at the engine's rate): a text the front end reads far longer than it looks is cut there."""
        if samples > (cap := self.limits.audio_cap_s(chars)) * SAMPLE_RATE:
            raise ProtocolError(
                "audio_too_long",
                f"the utterance's audio would pass {cap:g} s, the most "
                f"{chars} characters of text may become (max_audio_s, audio_s_per_char)",
            )

    async def open(
        self,
        clients: tuple,
        voice: str | None,
        speed: float,
        seed: int | None,
        on_queued=None,
        lexicon: Lexicon | None = None,
    ):
        """(ticket, engine stream): a slot from admission (waiting in its queue if need be), then the stream,
        its words said as ``lexicon`` says (default: the server's). The caller hands both back to `close`."""
        engine = await self.engine()
        asked = time.perf_counter()
        ticket = await self.admission.stream(clients, on_queued)
        stream = await self._open_stream(engine, ticket, voice, speed, seed)
        stream.text.lexicon = self.lexicon if lexicon is None else lexicon  # before any text is pushed
        stream.mark("request", asked)
        self.streams.add(stream)
        return ticket, stream

    def close(self, ticket, stream) -> None:
        """End an opened stream (a no-op once it has finished; else its engine slot frees) and free its slot
        in admission."""
        try:
            if stream in self.streams and self.timeline_log is not None:
                self._log_timeline(stream)
        finally:  # a diagnosis that fails costs its line, never the slot
            stream.cancel()
            self.streams.discard(stream)
            ticket.release()

    def shutdown(self) -> None:
        """The server has stopped: close the timeline log (a stream that ends later writes no line)."""
        if self.timeline_log is not None:
            self.timeline_log.close()

    def _log_timeline(self, stream) -> None:
        """One line per stream to TTS_TIMELINE_LOG: its way to the first audio (`Stream.timeline`) and the engine
        ticks from its first step to its first chunk."""
        ticks = stream.ticks
        self.timeline_log.write(
            {
                "at": stream.marks.get("request"),
                "timeline_ms": stream.timeline(),
                "ticks_to_due": ticks["due"] - ticks["stepped"] if {"due", "stepped"} <= set(ticks) else None,
                "finished": stream.finished and stream.error is None and not stream.cancelled,
            }
        )

    async def _open_stream(self, engine, ticket, voice, speed, seed):
        """The engine stream for a granted ticket; on any failure the ticket is released, but only once the
        engine has answered (a caller still waiting in the engine's queue keeps its slot in ours, so the server
        never sends the engine more callers than it has slots)."""
        # The engine's own FIFO wait covers the tick until a just-ended stream's slot is free, and other users
        # of the engine in this process.
        opening = asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(engine.open, voice, speed, seed=seed, wait_s=self.limits.queue_timeout_s)
        )
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:  # the client left while the engine was opening: end what it opens
            opening.add_done_callback(functools.partial(_abandon, ticket))
            raise
        except BaseException as err:
            ticket.release()
            if isinstance(err, ServerFull):
                raise ProtocolError(err.code, str(err), retry_after=self.admission.retry_after_s) from None
            if isinstance(err, UnknownVoice):
                raise ProtocolError(err.code, str(err), "voice") from None
            if isinstance(err, ValueError):
                raise ProtocolError("bad_value", str(err)) from None
            raise

    async def chunks(self, stream):
        """The stream's audio chunks as they are decoded (`Stream.next_chunk`: the engine's threads wake this
        loop; no thread waits per stream). A failure of this stream alone (its text, or the engine) raises
        ProtocolError."""
        while True:
            try:
                chunk = await stream.next_chunk()
            except TextError as err:  # nothing speakable, or text the front end refused
                raise ProtocolError("bad_text", str(err)) from None
            except Exception as err:  # EngineError, or whatever else the engine attributed to this stream
                raise ProtocolError("engine_error", f"speech generation failed: {err}") from None
            if chunk is None:
                return
            first = "read" not in stream.marks
            stream.mark("read")
            yield chunk
            if first:
                stream.mark("sent")  # the caller asks for the next chunk once this one is sent

    def stats(self) -> dict:
        figures = {
            "status": "ok",
            "sample_rate": SAMPLE_RATE,
            **self.admission.stats(),
            "max_connections": self.limits.max_connections,
            "max_queue": self.limits.max_queue,
            "awaiting_resume": sum(session.link is None for session in self.sessions),
        }
        if self._engine is not None:
            figures["slots"] = self._engine.max_streams
            if callable(stats := getattr(self._engine, "stats", None)):
                figures["engine"] = stats()
        return figures


class TimelineLog:
    """TTS_TIMELINE_LOG (a diagnosis, off by default; `bench.soak --timeline`): one JSON line per stream, appended
    whole (line buffered). Open while the server runs; after `close()` a line is dropped, not an error (a stream
    may end after the server has stopped). Used from the event loop's thread alone."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)

    @property
    def closed(self) -> bool:
        return self._file is None

    def write(self, line: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _abandon(ticket, opening) -> None:
    """The engine answered a caller that has gone: end the stream it opened, then free the caller's slot."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().cancel()
    ticket.release()


# ---- access: API keys, origins, client identity ---------------------------------------------------
def api_key(scope) -> str | None:
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


def clients_of(scope, hub: ServerContext) -> tuple:
    """The identities one connection counts against: its remote address, and its API key when keys are set."""
    address = relayed_address(scope) or (scope.get("client") or ("unknown",))[0]
    key = api_key(scope) if hub.api_keys else None
    return (("addr", address),) + ((("key", key),) if key else ())


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """No Origin (SDKs, CLIs), the server's own origin, or one on the allow-list ("*": any). "null" (a sandboxed
    page or a file) is refused unless listed. Example: Host 127.0.0.1:8000 allows http://127.0.0.1:8000."""
    if origin is None or origin in allowed or "*" in allowed:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host.lower()


def _open_streams(engine) -> int:
    """Streams the engine takes at once: its open streams (``max_open``: parked ones hold no slot), else its slots."""
    return getattr(engine, "max_open", engine.max_streams)
